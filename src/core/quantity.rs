//! Kubernetes resource quantities (`64Mi`, `1G`, `500m`, `1e3`), parsed
//! exactly and rounded up like `resource.Quantity.Value()` does, so a VMI
//! means the same bytes here as on a cluster.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::str::FromStr;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    #[error("{0:?} is not a quantity (expected a number with an optional suffix such as Mi, Gi, M, G, m)")]
    Syntax(String),
    #[error("{0:?} has an unknown suffix {1:?} (use Ki, Mi, Gi, Ti, Pi, Ei, k, M, G, T, P, E, m or an exponent)")]
    Suffix(String, String),
    #[error("{0:?} must not be negative")]
    Negative(String),
    #[error("{0:?} is too large")]
    Overflow(String),
}

/// A quantity as written in a manifest. Keeps the original text so that
/// serialising a VMI gives back what the user wrote; numbers are accepted
/// too, because YAML authors write `memory: 1024` and `cpu: 0.5`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Quantity(String);

impl Quantity {
    pub fn new(s: impl Into<String>) -> Self {
        Self(s.into())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The value in base units (bytes for memory and disks), rounded up.
    pub fn to_bytes(&self) -> Result<u64, QuantityError> {
        parse_bytes(&self.0)
    }

    /// The value in thousandths (millicores for CPU), rounded up.
    pub fn to_millis(&self) -> Result<u64, QuantityError> {
        parse_millis(&self.0)
    }
}

impl fmt::Display for Quantity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for Quantity {
    type Err = QuantityError;

    /// Validates the syntax; the plain constructor [`Quantity::new`] does not.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Parsed::parse(s)?;
        Ok(Self(s.to_owned()))
    }
}

impl Serialize for Quantity {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for Quantity {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // Syntax is checked by the converter, which can name the field.
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            S(String),
            U(u64),
            I(i64),
            F(f64),
        }
        Ok(Self(match Raw::deserialize(d)? {
            Raw::S(s) => s,
            Raw::U(u) => u.to_string(),
            Raw::I(i) => i.to_string(),
            Raw::F(f) => f.to_string(),
        }))
    }
}

/// Parses a quantity into bytes (or plain units), rounding fractions up.
pub fn parse_bytes(s: &str) -> Result<u64, QuantityError> {
    Parsed::parse(s)?.scaled(0, s)
}

/// Parses a quantity into thousandths of a unit (CPU millicores), rounding up.
pub fn parse_millis(s: &str) -> Result<u64, QuantityError> {
    Parsed::parse(s)?.scaled(3, s)
}

/// `digits × 10^exp10 × 2^exp2`, kept exact until the final rounding.
#[derive(Debug)]
struct Parsed {
    digits: u128,
    exp10: i32,
    exp2: u32,
}

impl Parsed {
    fn parse(s: &str) -> Result<Self, QuantityError> {
        let syntax = || QuantityError::Syntax(s.to_owned());
        let overflow = || QuantityError::Overflow(s.to_owned());
        let (negative, rest) = match s.as_bytes().first() {
            Some(b'-') => (true, &s[1..]),
            Some(b'+') => (false, &s[1..]),
            _ => (false, s),
        };
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (number, suffix) = rest.split_at(num_len);
        let (int, frac) = number.split_once('.').unwrap_or((number, ""));
        if int.is_empty() && frac.is_empty() || frac.contains('.') {
            return Err(syntax());
        }
        let mut digits: u128 = 0;
        for c in int.bytes().chain(frac.bytes()) {
            digits = digits
                .checked_mul(10)
                .and_then(|d| d.checked_add(u128::from(c - b'0')))
                .ok_or_else(overflow)?;
        }
        let frac_len = i32::try_from(frac.len()).map_err(|_| overflow())?;
        let (exp10, exp2) = match suffix {
            "" => (0, 0),
            "m" => (-3, 0),
            "k" => (3, 0),
            "M" => (6, 0),
            "G" => (9, 0),
            "T" => (12, 0),
            "P" => (15, 0),
            "E" => (18, 0),
            "Ki" => (0, 10),
            "Mi" => (0, 20),
            "Gi" => (0, 30),
            "Ti" => (0, 40),
            "Pi" => (0, 50),
            "Ei" => (0, 60),
            _ => match suffix.strip_prefix(['e', 'E']) {
                Some(exp) if !exp.is_empty() => {
                    let body = exp.strip_prefix(['+', '-']).unwrap_or(exp);
                    if body.is_empty() || !body.bytes().all(|b| b.is_ascii_digit()) {
                        return Err(syntax());
                    }
                    (exp.parse::<i32>().map_err(|_| overflow())?, 0)
                }
                _ => return Err(QuantityError::Suffix(s.to_owned(), suffix.to_owned())),
            },
        };
        if negative && digits != 0 {
            return Err(QuantityError::Negative(s.to_owned()));
        }
        Ok(Self {
            digits,
            exp10: exp10.checked_sub(frac_len).ok_or_else(overflow)?,
            exp2,
        })
    }

    /// The value × 10^extra10, rounded up to an integer.
    fn scaled(&self, extra10: i32, s: &str) -> Result<u64, QuantityError> {
        let overflow = || QuantityError::Overflow(s.to_owned());
        if self.digits == 0 {
            return Ok(0);
        }
        let exp10 = self.exp10 + extra10;
        let pow10 = |e: i32| 10u128.checked_pow(e.unsigned_abs()).ok_or_else(overflow);
        let mut num = self
            .digits
            .checked_mul(1u128 << self.exp2)
            .ok_or_else(overflow)?;
        let mut den = 1u128;
        if exp10 >= 0 {
            num = num.checked_mul(pow10(exp10)?).ok_or_else(overflow)?;
        } else {
            // Beyond 10^38 the value is certainly below one unit: rounds up to 1.
            den = match pow10(exp10) {
                Ok(d) => d,
                Err(_) => return Ok(1),
            };
        }
        u64::try_from(num.div_ceil(den)).map_err(|_| overflow())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes() {
        for (s, want) in [
            ("64Mi", 64 << 20),
            ("1Gi", 1 << 30),
            ("1G", 1_000_000_000),
            ("128M", 128_000_000),
            ("1024", 1024),
            ("1.5Gi", 3 << 29),
            ("1e3", 1000),
            ("1E3", 1000),
            ("2k", 2000),
            ("0", 0),
            ("+5", 5),
            ("0.5", 1),
            (".5Ki", 512),
            ("1e-2", 1),
            ("4Ei", 4 << 60),
        ] {
            assert_eq!(parse_bytes(s), Ok(want), "{s}");
        }
    }

    #[test]
    fn millis() {
        for (s, want) in [
            ("500m", 500),
            ("1", 1000),
            ("2.5", 2500),
            ("0.1", 100),
            ("1.0005", 1001),
        ] {
            assert_eq!(parse_millis(s), Ok(want), "{s}");
        }
    }

    #[test]
    fn errors_are_specific() {
        assert!(matches!(parse_bytes(""), Err(QuantityError::Syntax(_))));
        assert!(matches!(parse_bytes("Mi"), Err(QuantityError::Syntax(_))));
        assert!(matches!(
            parse_bytes("1.2.3"),
            Err(QuantityError::Syntax(_))
        ));
        assert!(matches!(parse_bytes("1e"), Err(QuantityError::Suffix(..))));
        assert!(matches!(parse_bytes("1e+"), Err(QuantityError::Syntax(_))));
        assert!(matches!(parse_bytes("1MB"), Err(QuantityError::Suffix(..))));
        assert!(matches!(
            parse_bytes("1 Gi"),
            Err(QuantityError::Suffix(..))
        ));
        assert!(matches!(
            parse_bytes("-1Gi"),
            Err(QuantityError::Negative(_))
        ));
        assert!(matches!(
            parse_bytes("16Ei"),
            Err(QuantityError::Overflow(_))
        ));
        assert!(matches!(
            parse_bytes("1e40"),
            Err(QuantityError::Overflow(_))
        ));
        let msg = parse_bytes("1MB").unwrap_err().to_string();
        assert!(msg.contains("\"MB\""), "{msg}");
    }

    #[test]
    fn serde_accepts_numbers_and_keeps_text() {
        let q: Vec<Quantity> = serde_json::from_str(r#"["1Gi", 1024, 0.5]"#).unwrap();
        assert_eq!(q[0].as_str(), "1Gi");
        assert_eq!(q[1].to_bytes(), Ok(1024));
        assert_eq!(q[2].to_millis(), Ok(500));
        assert_eq!(serde_json::to_string(&q[0]).unwrap(), r#""1Gi""#);
        assert!("12x".parse::<Quantity>().is_err());
        let y: Vec<Quantity> = serde_norway::from_str("[1Gi, 1024, 0.5, 1e3]").unwrap();
        let bytes: Vec<_> = y.iter().map(|q| q.to_bytes().unwrap()).collect();
        assert_eq!(bytes, [1 << 30, 1024, 1, 1000]);
    }
}
