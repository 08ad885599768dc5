//! Standard output for reports. A closed pipe (`fabriq demo | head -3`) is an error the
//! command returns (and `main` ends quietly on), not a panic as `println!` would raise.

use std::io::Write as _;

/// Writes `args` to standard output and flushes, so a closed reader is noticed at once.
pub fn write(args: std::fmt::Arguments<'_>) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_fmt(args)?;
    out.flush()
}

/// Whether `err` comes from standard output's reader having gone away.
pub fn is_closed_pipe(err: &anyhow::Error) -> bool {
    err.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// `println!` that returns the write's `std::io::Result` instead of panicking.
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::out::write(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `print!` that returns the write's `std::io::Result` instead of panicking.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::out::write(format_args!($($arg)*))
    };
}

pub(crate) use {out, outln};
