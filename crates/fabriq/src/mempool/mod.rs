//! Pre-registered memory pool (being built).
