//! The wall clock as the broker counts time.

/// Wall-clock milliseconds since the epoch (message TTLs count in these).
pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A wall-clock change seen by [`watch_jumps`] is logged when it is at least this large.
const JUMP_MS: i128 = 1_000;

/// Log every jump of the wall clock (an operator's or NTP's step, a restored VM): the
/// difference between how far the wall clock and the monotonic clock moved over a second.
/// Raft's timers and the leader's lease run on the monotonic clock and do not move; what
/// follows the wall clock does: message TTLs, `x-expires`, timestamps. The broker's clock
/// never goes back (`Broker::set_clock` keeps the latest), so after a jump back nothing
/// expires until the wall clock is past where it was.
pub(crate) async fn watch_jumps() {
    let mut mono = std::time::Instant::now();
    let mut wall = now_ms();
    loop {
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        let (mono_now, wall_now) = (std::time::Instant::now(), now_ms());
        let moved_mono = mono_now.duration_since(mono).as_millis() as i128;
        let moved_wall = wall_now as i128 - wall as i128;
        let jump = moved_wall - moved_mono;
        if jump.abs() >= JUMP_MS {
            tracing::warn!(
                jump_ms = jump as i64,
                "the wall clock jumped {} by {:.1} s: Raft and the leader's lease use the \
                 monotonic clock and are unaffected; message TTLs and x-expires follow the \
                 wall clock{}",
                if jump > 0 { "forward" } else { "back" },
                jump.abs() as f64 / 1000.0,
                if jump > 0 {
                    " (what was due before the new time expires now)"
                } else {
                    " (nothing expires until it is past the time it showed before)"
                }
            );
        }
        (mono, wall) = (mono_now, wall_now);
    }
}
