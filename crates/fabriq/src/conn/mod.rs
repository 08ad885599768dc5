//! Connection management (being built).
