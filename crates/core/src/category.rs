//! The stable label of an error: one short word (`lease_lost`, `too_large`, `unavailable`, …)
//! that metrics use as a label value, the sidecar returns as its error `code`, and the
//! controller uses as an Event reason. Messages may change; categories do not.

/// An error with a stable category (see the module doc).
pub trait Category {
    /// The error's stable label: lowercase ASCII words joined by `_`.
    fn category(&self) -> &'static str;
}
