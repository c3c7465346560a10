//! RFC 3339 wall-clock time without a date crate: the one formatter and parser of the project.
//!
//! Formatting is always UTC with a `Z` suffix. Parsing accepts what RFC 3339 allows: `T`, `t` or a
//! space between date and time, an optional fraction of any length (truncated to milliseconds), and
//! `Z`, `z` or a `±HH:MM` offset. Leap seconds (`:60`) are refused.

use std::time::{SystemTime, UNIX_EPOCH};

/// Current Unix time in milliseconds (0 if the clock is before 1970).
pub fn now_unix_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Current UTC time as RFC 3339 with whole seconds, e.g. `2026-11-29T21:04:05Z`.
pub fn now_rfc3339() -> String {
    rfc3339_from_unix(now_unix_ms().div_euclid(1000).max(0) as u64)
}

/// Formats Unix seconds as RFC 3339 UTC with whole seconds.
pub fn rfc3339_from_unix(secs: u64) -> String {
    let (date, rem) = split_secs(secs as i64);
    format!(
        "{date}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        (rem / 60) % 60,
        rem % 60
    )
}

/// Formats Unix milliseconds (negative: before 1970) as RFC 3339 UTC with three fraction digits,
/// e.g. `2026-11-29T21:04:05.123Z`.
pub fn rfc3339_from_unix_ms(ms: i64) -> String {
    let (date, rem) = split_secs(ms.div_euclid(1000));
    format!(
        "{date}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        (rem / 60) % 60,
        rem % 60,
        ms.rem_euclid(1000)
    )
}

/// Parses an RFC 3339 date-time into Unix milliseconds; `None` when it is not one.
pub fn parse_rfc3339_ms(s: &str) -> Option<i64> {
    let b = s.as_bytes();
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || b[13] != b':' || b[16] != b':' {
        return None;
    }
    if !matches!(b[10], b'T' | b't' | b' ') {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let d = b.get(r)?;
        if d.iter().all(u8::is_ascii_digit) {
            Some(d.iter().fold(0, |a, c| a * 10 + i64::from(c - b'0')))
        } else {
            None
        }
    };
    let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (h, mi, sec) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&mo) || d < 1 || d > days_in_month(y, mo) || h > 23 || mi > 59 || sec > 59
    {
        return None;
    }
    let mut i = 19;
    let mut frac_ms = 0;
    if b.get(i) == Some(&b'.') {
        i += 1;
        let start = i;
        while b.get(i).is_some_and(u8::is_ascii_digit) {
            i += 1;
        }
        if i == start {
            return None;
        }
        let digits = &b[start..i.min(start + 3)];
        frac_ms = digits.iter().fold(0, |a, c| a * 10 + i64::from(c - b'0'))
            * 10_i64.pow(3 - digits.len() as u32);
    }
    let offset_s = match b.get(i) {
        Some(b'Z' | b'z') if i + 1 == b.len() => 0,
        Some(&sign @ (b'+' | b'-')) if i + 6 == b.len() && b[i + 3] == b':' => {
            let (oh, om) = (num(i + 1..i + 3)?, num(i + 4..i + 6)?);
            if oh > 23 || om > 59 {
                return None;
            }
            let o = oh * 3600 + om * 60;
            if sign == b'+' { o } else { -o }
        }
        _ => return None,
    };
    let secs = days_from_civil(y, mo, d) * 86_400 + h * 3600 + mi * 60 + sec - offset_s;
    Some(secs * 1000 + frac_ms)
}

/// `YYYY-MM-DD` of the day holding Unix second `secs`, and the seconds into that day.
fn split_secs(secs: i64) -> (String, i64) {
    let (y, m, d) = civil_from_days(secs.div_euclid(86_400));
    (format!("{y:04}-{m:02}-{d:02}"), secs.rem_euclid(86_400))
}

/// Howard Hinnant's civil-from-days.
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// Howard Hinnant's days-from-civil (inverse of [`civil_from_days`]).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

fn days_in_month(y: i64, m: i64) -> i64 {
    match m {
        2 if y % 4 == 0 && (y % 100 != 0 || y % 400 == 0) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_dates() {
        assert_eq!(rfc3339_from_unix(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339_from_unix(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339_from_unix(1_795_986_245), "2026-11-29T21:04:05Z");
        assert_eq!(rfc3339_from_unix_ms(-1), "1969-12-31T23:59:59.999Z");
        assert_eq!(
            rfc3339_from_unix_ms(1_795_986_245_123),
            "2026-11-29T21:04:05.123Z"
        );
    }

    #[test]
    fn parses_offsets_fractions_and_separators() {
        let t = 1_795_986_245_000;
        assert_eq!(parse_rfc3339_ms("2026-11-29T21:04:05Z"), Some(t));
        assert_eq!(parse_rfc3339_ms("2026-11-29t21:04:05z"), Some(t));
        assert_eq!(parse_rfc3339_ms("2026-11-29 21:04:05Z"), Some(t));
        assert_eq!(parse_rfc3339_ms("2026-11-29T23:04:05+02:00"), Some(t));
        assert_eq!(parse_rfc3339_ms("2026-11-29T20:34:05-00:30"), Some(t));
        assert_eq!(parse_rfc3339_ms("2026-11-29T21:04:05.1Z"), Some(t + 100));
        assert_eq!(
            parse_rfc3339_ms("2026-11-29T21:04:05.123456789Z"),
            Some(t + 123)
        );
    }

    #[test]
    fn refuses_what_is_not_rfc3339() {
        for bad in [
            "",
            "yesterday",
            "2026-11-29",
            "2026-11-29T21:04:05",
            "2026-13-01T00:00:00Z",
            "2026-02-29T00:00:00Z",
            "2026-11-31T00:00:00Z",
            "2026-11-29T24:00:00Z",
            "2026-11-29T23:59:60Z",
            "2026-11-29T21:04:05.Z",
            "2026-11-29T21:04:05+2:00",
            "2026-11-29T21:04:05+02:00x",
            "2026-11-29T21:04:05Zjunk",
            "+026-11-29T21:04:05Z",
        ] {
            assert_eq!(parse_rfc3339_ms(bad), None, "{bad:?}");
        }
        assert!(parse_rfc3339_ms("2024-02-29T00:00:00Z").is_some());
    }

    #[test]
    fn round_trips_random_millisecond_times() {
        let seed = now_unix_ms() as u64 | 1;
        let mut x = seed;
        for _ in 0..10_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // 1900-01-01 .. 2200-01-01
            let ms = (x % 9_467_280_000_000) as i64 - 2_208_988_800_000;
            let s = rfc3339_from_unix_ms(ms);
            assert_eq!(parse_rfc3339_ms(&s), Some(ms), "seed {seed}: {s}");
        }
    }
}
