//! The memory high watermark (RabbitMQ's `vm_memory_high_watermark`): while the memory the
//! broker has allocated is above it, connections that publish are blocked (connection.blocked
//! "low on memory", and their sockets are not read), as with the disk alarm; consumers and
//! other clients carry on, so acknowledgements bring memory back down.

use std::path::Path;

/// The watermark as configured: a share of the machine's memory (RabbitMQ's default, 0.4) or
/// an absolute number of bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Watermark {
    Relative(f64),
    Absolute(u64),
}

impl Default for Watermark {
    fn default() -> Self {
        Watermark::Relative(0.4)
    }
}

impl Watermark {
    /// Parse `0.4` (relative: a fraction of at most 1), `1073741824` (bytes) or a number with a
    /// unit as RabbitMQ's `vm_memory_high_watermark.absolute` takes them (`512MiB`, `2GB`,
    /// `100MB`, `64KiB`, ...).
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let split = s
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(s.len());
        let (number, unit) = s.split_at(split);
        let unit = unit.trim();
        if unit.is_empty() {
            if number.contains('.') || number == "0" || number == "1" {
                let f: f64 = number.parse().map_err(|_| format!("not a number: {s}"))?;
                if !(0.0..=1.0).contains(&f) {
                    return Err(format!("a relative watermark is between 0 and 1: {s}"));
                }
                return Ok(Watermark::Relative(f));
            }
            return number
                .parse()
                .map(Watermark::Absolute)
                .map_err(|_| format!("not a number of bytes: {s}"));
        }
        let n: u64 = number
            .parse()
            .map_err(|_| format!("not a number of bytes: {s}"))?;
        let factor: u64 = match unit.to_ascii_lowercase().as_str() {
            "b" => 1,
            "kb" | "k" => 1000,
            "kib" | "ki" => 1 << 10,
            "mb" | "m" => 1000 * 1000,
            "mib" | "mi" => 1 << 20,
            "gb" | "g" => 1000 * 1000 * 1000,
            "gib" | "gi" => 1 << 30,
            "tb" | "t" => 1000 * 1000 * 1000 * 1000,
            "tib" | "ti" => 1 << 40,
            _ => return Err(format!("unknown unit {unit:?} in {s}")),
        };
        n.checked_mul(factor)
            .map(Watermark::Absolute)
            .ok_or_else(|| format!("too large: {s}"))
    }

    /// The limit in bytes, given the machine's memory.
    pub fn bytes(self, total: u64) -> u64 {
        match self {
            Watermark::Relative(f) => (total as f64 * f) as u64,
            Watermark::Absolute(b) => b,
        }
    }
}

/// The memory available to this process: the machine's (`MemTotal`), or its cgroup's limit
/// when lower (a container).
pub fn total_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let total = kib_field(&meminfo, "MemTotal:")?;
    let cgroup = std::fs::read_to_string(Path::new("/sys/fs/cgroup/memory.max"))
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok());
    Some(cgroup.map_or(total, |c| c.min(total)))
}

static METER: std::sync::OnceLock<fn() -> u64> = std::sync::OnceLock::new();

/// Measure memory with `meter` (the binary's counting allocator: bytes allocated on the heap)
/// instead of the resident set.
pub fn set_meter(meter: fn() -> u64) {
    let _ = METER.set(meter);
}

/// The memory the watermark is compared with: what the binary's allocator counts, or (in a
/// process without that meter, such as the tests' in-process server) the resident set.
pub fn used() -> Option<u64> {
    match METER.get() {
        Some(meter) => Some(meter()),
        None => resident(),
    }
}

/// This process's resident memory (VmRSS), in bytes.
pub fn resident() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    kib_field(&status, "VmRSS:")
}

/// A `Name:   1234 kB` line of a /proc file, in bytes.
fn kib_field(text: &str, name: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(name))?;
    let kib: u64 = line[name.len()..].split_whitespace().next()?.parse().ok()?;
    Some(kib.saturating_mul(1024))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watermarks_parse_as_rabbitmq_writes_them() {
        assert_eq!(Watermark::parse("0.4"), Ok(Watermark::Relative(0.4)));
        assert_eq!(Watermark::parse("1"), Ok(Watermark::Relative(1.0)));
        assert_eq!(
            Watermark::parse("1073741824"),
            Ok(Watermark::Absolute(1 << 30))
        );
        assert_eq!(
            Watermark::parse("512MiB"),
            Ok(Watermark::Absolute(512 << 20))
        );
        assert_eq!(
            Watermark::parse("2GB"),
            Ok(Watermark::Absolute(2_000_000_000))
        );
        assert!(Watermark::parse("1.5").is_err());
        assert!(Watermark::parse("12 parsecs").is_err());
        assert!(Watermark::parse("").is_err());
        assert_eq!(Watermark::Relative(0.5).bytes(1000), 500);
        assert_eq!(Watermark::Absolute(7).bytes(1000), 7);
    }

    #[test]
    fn this_process_has_memory() {
        assert!(resident().is_some_and(|r| r > 0));
        assert!(total_memory().is_some_and(|t| t > 0));
        assert_eq!(kib_field("VmRSS:\t  12 kB\n", "VmRSS:"), Some(12 * 1024));
    }
}
