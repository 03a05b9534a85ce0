//! Human-readable units in configuration: byte sizes ("512MiB", "64KiB", "1GB", "4096")
//! and durations ("30s", "5m", "250ms", "1h 30m").
//!
//! Both types deserialize from strings (or plain integers: bytes, or milliseconds for
//! durations) and display back in a form that parses to the same value.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer, de};

/// A number of bytes written with an optional binary (KiB, MiB, GiB, TiB) or decimal
/// (KB, MB, GB, TB) suffix. A bare number is bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteSize(pub u64);

impl ByteSize {
    pub const fn kib(n: u64) -> Self {
        Self(n * 1024)
    }
    pub const fn mib(n: u64) -> Self {
        Self(n * 1024 * 1024)
    }
    pub const fn gib(n: u64) -> Self {
        Self(n * 1024 * 1024 * 1024)
    }
    pub const fn bytes(self) -> u64 {
        self.0
    }
}

/// Why a size or duration string did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct UnitError(String);

impl FromStr for ByteSize {
    type Err = UnitError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let trimmed = text.trim();
        let split = trimmed
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(trimmed.len());
        let (digits, unit) = trimmed.split_at(split);
        if digits.is_empty() {
            return Err(UnitError(format!(
                "invalid size {text:?}: expected a whole number with an optional unit such as \"512MiB\""
            )));
        }
        let value: u64 = digits
            .parse()
            .map_err(|_| UnitError(format!("invalid size {text:?}: number too large")))?;
        let multiplier: u64 = match unit.trim() {
            "" | "B" | "b" => 1,
            "KiB" | "K" | "k" => 1 << 10,
            "MiB" | "M" => 1 << 20,
            "GiB" | "G" => 1 << 30,
            "TiB" | "T" => 1 << 40,
            "KB" | "kB" => 1_000,
            "MB" => 1_000_000,
            "GB" => 1_000_000_000,
            "TB" => 1_000_000_000_000,
            other => {
                return Err(UnitError(format!(
                    "invalid size {text:?}: unknown unit {other:?} (use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB)"
                )));
            }
        };
        value
            .checked_mul(multiplier)
            .map(ByteSize)
            .ok_or_else(|| UnitError(format!("invalid size {text:?}: overflows 64 bits")))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [(u64, &str); 4] = [
            (1 << 40, "TiB"),
            (1 << 30, "GiB"),
            (1 << 20, "MiB"),
            (1 << 10, "KiB"),
        ];
        for (size, name) in UNITS {
            if self.0 >= size && self.0.is_multiple_of(size) {
                return write!(f, "{}{}", self.0 / size, name);
            }
        }
        write!(f, "{}B", self.0)
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(UnitVisitor::<ByteSize>::new(
            "a byte size such as \"512MiB\"",
        ))
    }
}

/// A duration written the humantime way ("30s", "5m", "1h 30m", "250ms"). A bare integer
/// is milliseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct HumanDuration(pub Duration);

impl HumanDuration {
    pub const fn secs(n: u64) -> Self {
        Self(Duration::from_secs(n))
    }
    pub const fn millis(n: u64) -> Self {
        Self(Duration::from_millis(n))
    }
    pub const fn get(self) -> Duration {
        self.0
    }
}

impl FromStr for HumanDuration {
    type Err = UnitError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let trimmed = text.trim();
        if !trimmed.is_empty() && trimmed.bytes().all(|b| b.is_ascii_digit()) {
            let millis: u64 = trimmed
                .parse()
                .map_err(|_| UnitError(format!("invalid duration {text:?}: number too large")))?;
            return Ok(Self(Duration::from_millis(millis)));
        }
        humantime::parse_duration(trimmed).map(Self).map_err(|err| {
            UnitError(format!(
                "invalid duration {text:?}: {err} (examples: \"250ms\", \"30s\", \"5m\")"
            ))
        })
    }
}

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", humantime::format_duration(self.0))
    }
}

impl Serialize for HumanDuration {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(UnitVisitor::<HumanDuration>::new(
            "a duration such as \"30s\"",
        ))
    }
}

impl From<HumanDuration> for Duration {
    fn from(value: HumanDuration) -> Self {
        value.0
    }
}

/// Accepts a string (parsed with `FromStr`) or an unsigned integer (parsed as its decimal text).
struct UnitVisitor<T> {
    expecting: &'static str,
    _marker: std::marker::PhantomData<T>,
}

impl<T> UnitVisitor<T> {
    fn new(expecting: &'static str) -> Self {
        Self {
            expecting,
            _marker: std::marker::PhantomData,
        }
    }
}

impl<T> de::Visitor<'_> for UnitVisitor<T>
where
    T: FromStr<Err = UnitError>,
{
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.expecting)
    }

    fn visit_str<E: de::Error>(self, value: &str) -> Result<T, E> {
        value.parse().map_err(|err: UnitError| E::custom(err))
    }

    fn visit_u64<E: de::Error>(self, value: u64) -> Result<T, E> {
        self.visit_str(&value.to_string())
    }

    fn visit_i64<E: de::Error>(self, value: i64) -> Result<T, E> {
        if value < 0 {
            return Err(E::custom(format!(
                "{value} is negative; {}",
                self.expecting
            )));
        }
        self.visit_str(&value.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_binary_and_decimal_units() {
        assert_eq!("512MiB".parse::<ByteSize>().unwrap(), ByteSize::mib(512));
        assert_eq!("64 KiB".parse::<ByteSize>().unwrap(), ByteSize::kib(64));
        assert_eq!("1GB".parse::<ByteSize>().unwrap(), ByteSize(1_000_000_000));
        assert_eq!("4096".parse::<ByteSize>().unwrap(), ByteSize(4096));
        assert!("12 parsecs".parse::<ByteSize>().is_err());
        assert!("MiB".parse::<ByteSize>().is_err());
        assert!("-1MiB".parse::<ByteSize>().is_err());
        assert!("99999999999TiB".parse::<ByteSize>().is_err());
    }

    #[test]
    fn sizes_display_round_trips() {
        for size in [
            ByteSize(0),
            ByteSize(1000),
            ByteSize::kib(3),
            ByteSize::mib(512),
            ByteSize::gib(2),
        ] {
            assert_eq!(size.to_string().parse::<ByteSize>().unwrap(), size);
        }
    }

    #[test]
    fn durations_parse_humantime_and_bare_millis() {
        assert_eq!(
            "30s".parse::<HumanDuration>().unwrap(),
            HumanDuration::secs(30)
        );
        assert_eq!(
            "1h 30m".parse::<HumanDuration>().unwrap(),
            HumanDuration::secs(5400)
        );
        assert_eq!(
            "250".parse::<HumanDuration>().unwrap(),
            HumanDuration::millis(250)
        );
        assert!("soon".parse::<HumanDuration>().is_err());
        let shown = HumanDuration::millis(1500).to_string();
        assert_eq!(
            shown.parse::<HumanDuration>().unwrap(),
            HumanDuration::millis(1500)
        );
    }
}
