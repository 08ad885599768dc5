//! The subcommand table.
//!
//! Every subcommand is a module `cmd/<name>.rs` (or `cmd/<name>/mod.rs`) exposing
//! `pub struct Args` (a `clap::Args`, whose doc comment is the subcommand's help) and
//! `pub fn run(args: Args) -> anyhow::Result<()>`. Registering one is one line in the
//! `commands!` invocation below: `module => Variant`.

/// Declares the subcommand modules, the [`Command`] enum that clap parses, and its dispatch.
macro_rules! commands {
    ($($module:ident => $variant:ident),+ $(,)?) => {
        $(pub mod $module;)+

        /// A `fabriq` subcommand.
        #[derive(Debug, clap::Subcommand)]
        pub enum Command {
            $(
                #[allow(missing_docs)]
                $variant($module::Args),
            )+
        }

        impl Command {
            /// Run the chosen subcommand.
            pub fn run(self) -> anyhow::Result<()> {
                match self {
                    $(Command::$variant(args) => $module::run(args),)+
                }
            }
        }
    };
}

commands! {
    demo => Demo,
    info => Info,
    perf => Perf,
}
