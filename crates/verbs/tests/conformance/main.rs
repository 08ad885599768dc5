//! The cross-provider conformance suite of fabriq-verbs.
//!
//! Every behaviour is written once, as a function generic over
//! [`harness::TestProvider`], in the area module it belongs to (`devices`, `ops`, `access`,
//! `recv`, `qp_state`, `cq`, `srq`, `concurrency`, `failure`, `atomics`). The `providers!`
//! list at the bottom stamps out one module per provider holding one `#[test]` per behaviour,
//! so a failure reads `tcp::rc_write_outside_mr_is_remote_access_error`. The design is in
//! `docs/arch/conformance.md`.
//!
//! A provider joins with one line in `providers!`. Select providers at run time with
//! `FABRIQ_CONFORMANCE_PROVIDERS=tcp,shm`; a provider whose device is absent (no NIC, feature
//! off) skips every test with a message on stderr.
//!
//! Peers live in separate processes: the test binary re-executes itself running only the
//! ignored test [`peer_process`] with `FABRIQ_CONFORMANCE_CTRL` set, and obeys the commands of
//! [`peer`] over a TCP control socket on 127.0.0.1.

mod access;
mod atomics;
mod concurrency;
mod cq;
mod devices;
mod failure;
mod harness;
mod ops;
mod peer;
mod qp_state;
mod recv;
mod srq;

/// The peer side of the suite. Runs only when the suite re-executes itself as a peer
/// (`FABRIQ_CONFORMANCE_CTRL` set); otherwise it returns at once.
#[test]
#[ignore = "entry point of the conformance peer process, started by the suite itself"]
fn peer_process() {
    peer::peer_main();
}

/// Every conformance test, written once as `area::test_name`. `$callback` is invoked with its
/// own arguments followed by `;` and the list.
macro_rules! conformance_tests {
    ($callback:ident ! ($($args:tt)*)) => {
        $callback! { $($args)* ;
            devices::device_lists_and_opens_with_sane_attributes,
            devices::device_open_rejects_unknown_options,
            devices::mr_alloc_is_zeroed_with_distinct_keys,
            ops::rc_send_delivers_payload_wr_id_and_byte_len,
            ops::rc_send_with_imm_delivers_immediate_data,
            ops::rc_zero_length_send_completes,
            ops::rc_write_places_data_in_remote_mr,
            ops::rc_write_with_imm_places_data_and_consumes_a_receive,
            ops::rc_read_fetches_remote_data,
            ops::rc_large_write_and_read_round_trip,
            ops::rc_compare_and_swap_swaps_only_on_match,
            ops::rc_fetch_and_add_returns_original_and_adds,
            ops::rc_send_gathers_sge_list_and_receive_scatters,
            ops::rc_write_gathers_and_read_scatters_sge_lists,
            ops::rc_inline_send_copies_payload_at_post_time,
            ops::rc_inline_above_max_inline_is_refused,
            ops::rc_inline_data_goes_ahead_of_the_sge_list,
            ops::rc_inline_sge_of_unreadable_memory_is_an_error,
            ops::rc_unsignaled_requests_complete_silently,
            ops::rc_sq_sig_all_signals_every_request,
            ops::rc_write_then_send_data_visible_at_receive_completion,
            ops::rc_batch_completes_in_post_order,
            ops::rc_synchronise_write_lands_after_earlier_writes,
            ops::rc_bad_local_lkey_is_local_protection_error,
            ops::rc_access_at_the_region_edges_succeeds,
            ops::rc_partially_posted_batch_completes_the_posted_prefix,
            ops::rc_write_and_read_user_memory_region,
            ops::rc_peer_initiated_operations_reach_this_process,
            access::rc_write_without_remote_write_is_remote_access_error,
            access::rc_read_without_remote_read_is_remote_access_error,
            access::rc_atomic_without_remote_atomic_is_remote_access_error,
            access::rc_write_outside_mr_is_remote_access_error,
            access::rc_read_outside_mr_is_remote_access_error,
            access::rc_atomic_outside_mr_is_remote_access_error,
            access::rc_write_with_wrong_rkey_is_remote_access_error,
            access::rc_write_to_deregistered_mr_is_remote_access_error,
            access::rc_access_not_granted_by_the_qp_is_remote_access_error,
            access::rc_rkey_of_another_pd_is_remote_access_error,
            access::rc_unsignaled_request_that_fails_still_completes,
            access::rc_misaligned_atomic_is_remote_invalid_request,
            ops::rc_local_sge_of_another_pd_is_local_protection_error,
            recv::rc_receive_too_small_is_local_length_error,
            recv::rc_send_waits_for_late_receive_within_rnr_retry,
            recv::rc_send_without_receive_exhausts_rnr_retry,
            recv::rc_send_stream_with_reposted_receives_is_intact,
            recv::rc_write_with_imm_waits_for_a_receive,
            ops::rc_too_many_sges_are_refused,
            qp_state::qp_state_machine_allows_exactly_the_legal_transitions,
            qp_state::qp_posting_in_wrong_state_is_wrong_state_error,
            qp_state::qp_error_flushes_outstanding_send_and_recv,
            qp_state::qp_posting_in_error_completes_with_wr_flushed,
            qp_state::qp_request_posted_in_error_completes_after_the_ones_before_it,
            qp_state::qp_full_send_queue_is_back_pressure,
            qp_state::qp_reset_and_reconnect_carries_traffic_again,
            qp_state::qp_reset_frees_the_full_depth_of_both_queues,
            qp_state::qp_reset_gives_a_new_initial_psn,
            qp_state::qp_rtr_before_peer_carries_traffic,
            qp_state::qp_rtr_toward_another_providers_endpoint_is_refused,
            cq::cq_overflow_is_reported,
            cq::cq_event_fd_wakes_a_sleeper_on_completion,
            cq::cq_event_fires_once_per_arm,
            cq::cq_event_fd_wakes_on_a_message_from_the_peer,
            cq::cq_solicited_only_arm_wakes_on_solicited_send,
            srq::srq_is_shared_by_two_qps,
            srq::srq_receives_survive_an_error_on_one_qp,
            concurrency::rc_many_outstanding_reads_complete_in_order,
            concurrency::rc_posting_from_several_threads_is_safe,
            concurrency::rc_many_qps_between_two_contexts_stay_separate,
            concurrency::rc_bidirectional_bulk_writes_do_not_deadlock,
            qp_state::qp_full_receive_queue_is_back_pressure,
            qp_state::qp_query_reports_the_attributes_in_force,
            failure::peer_killed_moves_qp_to_error_and_flushes,
            failure::peer_killed_one_sided_write_does_not_succeed,
            failure::peer_destroyed_qp_makes_requests_fail,
            atomics::fetch_and_add_from_two_processes_sums_exactly,
            atomics::cas_spin_lock_guards_counter_across_two_processes,
        }
    };
}

/// Stamp out one provider module with one `#[test]` per conformance test.
macro_rules! stamp_provider {
    ($module:ident, $provider:literal, $device:literal, [$($key:literal = $value:literal),*] ; $($area:ident :: $test:ident),* $(,)?) => {
        #[doc = concat!("Conformance tests of provider `", $provider, "`.")]
        mod $module {
            /// The provider under test.
            pub struct Target;

            impl crate::harness::TestProvider for Target {
                const MODULE: &'static str = stringify!($module);
                const PROVIDER: &'static str = $provider;
                const DEVICE: &'static str = $device;

                fn device_config() -> fabriq_verbs::DeviceConfig {
                    #[allow(unused_mut)]
                    let mut config = fabriq_verbs::DeviceConfig::default();
                    $( config.options.insert($key.into(), $value.into()); )*
                    config
                }
            }

            $(
                #[test]
                fn $test() {
                    crate::harness::run::<Target>(stringify!($test), crate::$area::$test::<Target>);
                }
            )*
        }
    };
}

/// The providers under test: `module => "provider" on "device"`, optionally `with` device
/// options the device is opened with (here and in peers). A device of `"*"` means the first
/// device that provider lists (hardware providers). One line per provider and setting.
macro_rules! providers {
    ($($module:ident => $provider:literal on $device:literal $(with $($key:literal = $value:literal),+)?),* $(,)?) => {
        $( conformance_tests!(stamp_provider!($module, $provider, $device, [$($($key = $value),+)?])); )*
    };
}

providers! {
    shm => "shm" on "shm0",
    tcp => "tcp" on "tcp0",
    // Busy progress: CQ pollers read the sockets (what the middleware opens tcp0 and udp0 with).
    tcp_busy => "tcp" on "tcp0" with "progress" = "busy",
    rdma_core => "rdma-core" on "*",
    udp => "udp" on "udp0",
    udp_busy => "udp" on "udp0" with "progress" = "busy",
}
