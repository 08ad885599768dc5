//! The devices the end-to-end tests run on: `FABRIQ_TEST_DEVICES` (comma-separated), else
//! `tcp0,shm0`. Included by the test files that use it (`#[path]`), so that test binaries
//! without it build no unused copy.

pub fn devices() -> Vec<String> {
    std::env::var("FABRIQ_TEST_DEVICES")
        .unwrap_or_else(|_| "tcp0,shm0".into())
        .split(',')
        .map(|d| d.trim().to_string())
        .filter(|d| !d.is_empty())
        .collect()
}
