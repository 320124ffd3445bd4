//! Rate limits for log lines that repeat (a full disk fails every store write; an exhausted
//! file table fails every accept): the first occurrence is logged at once, then at most one
//! line per interval, saying how many occurrences it stands for. Without this a full disk wrote
//! 210,283 ERROR lines in 25 s.

use std::time::Duration;

/// How often a repeating error is logged at most.
pub const INTERVAL: Duration = Duration::from_secs(10);

#[derive(Debug, Default, Clone)]
pub struct Repeats {
    /// When the last line was logged (ms, on the caller's clock).
    last: Option<u64>,
    /// Occurrences since the last line that was logged.
    suppressed: u64,
}

impl Repeats {
    /// Call on each occurrence, with the time in ms (any clock that does not run backwards by
    /// much; the core passes its own, set by the server): `Some(n)` when a line should be
    /// logged now, `n` being how many occurrences were not logged since the previous line.
    pub fn hit(&mut self, now_ms: u64) -> Option<u64> {
        match self.last {
            Some(t) if now_ms.saturating_sub(t) < INTERVAL.as_millis() as u64 => {
                self.suppressed += 1;
                None
            }
            _ => {
                self.last = Some(now_ms);
                Some(std::mem::take(&mut self.suppressed))
            }
        }
    }

    /// The condition ended: `Some(n)` if occurrences went unlogged since the last line (say so
    /// once), and the next occurrence is logged at once.
    pub fn clear(&mut self) -> Option<u64> {
        self.last = None;
        let n = std::mem::take(&mut self.suppressed);
        (n > 0).then_some(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_then_once_per_interval_with_counts() {
        let mut r = Repeats::default();
        let t0 = 1_000_000u64;
        let interval = INTERVAL.as_millis() as u64;
        assert_eq!(r.hit(t0), Some(0));
        for i in 1..=1000 {
            assert_eq!(r.hit(t0 + i), None);
        }
        assert_eq!(r.hit(t0 + interval), Some(1000));
        assert_eq!(r.hit(t0 + interval + 1), None);
        assert_eq!(r.clear(), Some(1));
        assert_eq!(r.clear(), None);
        assert_eq!(r.hit(t0 + interval + 2), Some(0));
    }
}
