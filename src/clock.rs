//! The wall clock as the broker counts time.

/// Wall-clock milliseconds since the epoch (message TTLs count in these).
pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
