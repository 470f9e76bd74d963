//! Human-readable quantities for the text output (decimal units, as the papers use).

use std::fmt;

pub(crate) use kvroute_costmodel::Micros;

/// Bytes with a decimal unit: `559.1 kB`, `63.70 MB`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bytes(pub(crate) f64);

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        if b >= 1e9 {
            write!(f, "{:.2} GB", b / 1e9)
        } else if b >= 1e6 {
            write!(f, "{:.2} MB", b / 1e6)
        } else if b >= 1e3 {
            write!(f, "{:.1} kB", b / 1e3)
        } else {
            write!(f, "{b:.0} B")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_pick_a_readable_unit() {
        assert_eq!(Bytes(0.0).to_string(), "0 B");
        assert_eq!(Bytes(2184.0).to_string(), "2.2 kB");
        assert_eq!(Bytes(63_700_992.0).to_string(), "63.70 MB");
        assert_eq!(Bytes(3.2e9).to_string(), "3.20 GB");
        assert_eq!(Micros(45.12).to_string(), "45.1 us");
        assert_eq!(Micros(5449.0).to_string(), "5.449 ms");
    }
}
