//! Protocol scenarios: two connections driven through the [`pair::Pair`] harness in
//! virtual time, one test per protocol rule, plus property tests.

mod pair;
mod props;
mod rules;
mod scenarios;
mod sim_issues;
mod single_path;
