//! A token bucket per API key: `rate` requests a second on average, bursts of `burst`.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Requests a second and burst size of one key.
#[derive(Debug, Clone, Copy)]
pub struct RateLimit {
    pub per_second: f64,
    pub burst: f64,
}

/// Default: generous for agents, a wall against runaway loops.
pub const DEFAULT_RATE_LIMIT: RateLimit = RateLimit {
    per_second: 1000.0,
    burst: 2000.0,
};

/// One token bucket.
#[derive(Debug)]
pub struct Bucket {
    limit: RateLimit,
    state: Mutex<(f64, Instant)>,
}

impl Bucket {
    pub fn new(limit: RateLimit) -> Bucket {
        Bucket {
            limit,
            state: Mutex::new((limit.burst, Instant::now())),
        }
    }

    /// Takes one token now; `Err(wait)` when there is none, with the wait until the next.
    pub fn take(&self) -> Result<(), Duration> {
        self.take_at(Instant::now())
    }

    fn take_at(&self, now: Instant) -> Result<(), Duration> {
        let mut st = self.state.lock().expect("rate limit");
        let (tokens, last) = *st;
        let elapsed = now.saturating_duration_since(last).as_secs_f64();
        let tokens = (tokens + elapsed * self.limit.per_second).min(self.limit.burst);
        if tokens >= 1.0 {
            *st = (tokens - 1.0, now);
            Ok(())
        } else {
            *st = (tokens, now);
            Err(Duration::from_secs_f64(
                (1.0 - tokens) / self.limit.per_second.max(f64::MIN_POSITIVE),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bursts_then_refills_at_the_rate() {
        let per_second = rand::random_range(5.0..50.0);
        let burst = rand::random_range(3..20) as f64;
        let b = Bucket::new(RateLimit { per_second, burst });
        let t0 = Instant::now();
        for i in 0..burst as usize {
            assert!(b.take_at(t0).is_ok(), "request {i} of the burst");
        }
        let wait = b.take_at(t0).unwrap_err();
        assert!(
            (wait.as_secs_f64() - 1.0 / per_second).abs() < 1e-6,
            "{wait:?}"
        );
        // One second later exactly `per_second` more pass (capped by the burst).
        let t1 = t0 + Duration::from_secs(1);
        let passed = (0..100).filter(|_| b.take_at(t1).is_ok()).count();
        assert_eq!(passed, (per_second.min(burst)).floor() as usize);
    }
}
