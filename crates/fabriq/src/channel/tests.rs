//! Behaviour of the channel core, driven through the fake queue-pair harness in virtual time.
//! Grouped by what the channel starts with: an open channel, a slow receiver, a failing QP.
#![allow(clippy::needless_range_loop, clippy::field_reassign_with_default)]

use fabriq_verbs::{RemoteAddr, Rkey, WcOpcode, WcStatus};
use proptest::prelude::*;

use super::harness::{Got, Pair};
use super::proto::{ChannelConfig, ChannelCore, PeerGeometry, Thresholds};
use super::wire::{self, FrameBody, HeadBuf, MsgHeader, MsgKind, TraceHeader};
use super::ChannelError;

fn data(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn small_ring() -> ChannelConfig {
    ChannelConfig {
        rx_slots: 8,
        max_queued: 8,
        ..ChannelConfig::default()
    }
}

fn assert_clean(p: &Pair) {
    for s in &p.sides {
        assert!(s.errors.is_empty(), "errors: {:?}", s.errors);
        assert_eq!(s.rnr_events, 0, "a SEND found no posted receive");
    }
}

mod open_channel {
    use super::*;

    #[test]
    fn eager_message_arrives_intact_and_sender_buffer_is_returned() {
        let mut p = Pair::symmetric(ChannelConfig::default());
        let id = p.send(0, data(100, 1)).expect("accepted");
        p.drive();
        assert_eq!(p.sides[1].received, vec![(1, Got::Bytes(data(100, 1)))]);
        assert_eq!(p.sides[0].completed, vec![id]);
        assert_eq!(p.sides[0].core.stats().eager_sent, 1);
        assert!(p.sides[0].core.is_idle() && p.sides[1].core.is_idle());
        assert_clean(&p);
    }

    #[test]
    fn zero_byte_message_keeps_its_boundary() {
        let mut p = Pair::symmetric(ChannelConfig::default());
        p.send(0, Vec::new()).expect("accepted");
        p.send(0, vec![7]).expect("accepted");
        p.drive();
        assert_eq!(
            p.sides[1].received,
            vec![(1, Got::Bytes(vec![])), (2, Got::Bytes(vec![7]))]
        );
        assert_clean(&p);
    }

    #[test]
    fn rendezvous_pulls_in_chunks_and_fin_frees_the_sender_buffer() {
        let cfg = ChannelConfig::default();
        let chunk = cfg.thresholds.chunk_size as usize;
        let mut p = Pair::symmetric(cfg);
        let len = chunk * 5 + 17;
        let id = p.send(0, data(len, 9)).expect("accepted");
        p.drive();
        assert_eq!(p.sides[1].received, vec![(1, Got::Bytes(data(len, 9)))]);
        assert_eq!(p.sides[0].core.stats().rendezvous_sent, 1);
        assert_eq!(p.sides[1].core.stats().reads_posted, 6);
        assert_eq!(p.sides[1].core.stats().fins_sent, 1);
        assert_eq!(p.sides[0].completed, vec![id]);
        assert_clean(&p);
    }

    #[test]
    fn sizes_around_both_thresholds_keep_order_and_bytes() {
        let cfg = ChannelConfig::default();
        let e = cfg.thresholds.eager_max as usize;
        let c = cfg.thresholds.chunk_size as usize;
        let sizes = [
            0,
            1,
            e - 1,
            e,
            e + 1,
            c - 1,
            c,
            c + 1,
            4 * c,
            4 * c + 1,
            9 * c - 1,
        ];
        let mut p = Pair::symmetric(cfg);
        for (i, &n) in sizes.iter().enumerate() {
            p.send(0, data(n, i as u8)).expect("accepted");
        }
        p.drive();
        let want: Vec<_> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| (i as u64 + 1, Got::Bytes(data(n, i as u8))))
            .collect();
        assert_eq!(p.sides[1].received, want);
        assert_eq!(p.sides[0].completed.len(), sizes.len());
        assert_clean(&p);
    }

    #[test]
    fn one_gibibyte_message_is_pulled_whole_at_matching_offsets() {
        let mut p = Pair::symmetric(ChannelConfig::default());
        p.sides[1].sink_buffers = true;
        let len = (1u64 << 30) + 3;
        p.send_pattern(0, len).expect("accepted");
        p.send(0, data(10, 3)).expect("accepted");
        p.drive();
        assert_eq!(
            p.sides[1].received,
            vec![(1, Got::Pattern(len)), (2, Got::Bytes(data(10, 3)))]
        );
        let chunk = u64::from(ChannelConfig::default().thresholds.chunk_size);
        assert_eq!(p.sides[1].core.stats().reads_posted, len.div_ceil(chunk));
        assert_clean(&p);
    }

    #[test]
    fn thresholds_change_on_a_live_channel() {
        let mut p = Pair::symmetric(ChannelConfig::default());
        p.send(0, data(3000, 1)).expect("accepted");
        p.drive();
        assert_eq!(p.sides[0].core.stats().eager_sent, 1);
        p.sides[0]
            .core
            .set_thresholds(Thresholds::for_link_speed(25))
            .expect("valid");
        p.send(0, data(3000, 2)).expect("accepted");
        p.drive();
        assert_eq!(p.sides[0].core.stats().rendezvous_sent, 1);
        assert_eq!(p.sides[1].received[1], (2, Got::Bytes(data(3000, 2))));
        // The 200 Gb/s profile raises the eager limit up to what the peer's slots hold.
        p.sides[0]
            .core
            .set_thresholds(Thresholds::for_link_speed(200))
            .expect("valid");
        assert_eq!(p.sides[0].core.eager_limit(), 8 << 10);
        assert_clean(&p);
    }

    #[test]
    fn link_speed_profiles() {
        assert_eq!(Thresholds::for_link_speed(25).eager_max, 2048);
        assert_eq!(Thresholds::for_link_speed(25).chunk_size, 32 << 10);
        assert_eq!(Thresholds::for_link_speed(100).eager_max, 4096);
        assert_eq!(Thresholds::for_link_speed(100).chunk_size, 64 << 10);
        assert_eq!(Thresholds::for_link_speed(200).eager_max, 8192);
        assert_eq!(Thresholds::for_link_speed(200).chunk_size, 128 << 10);
    }

    #[test]
    fn pipelined_traffic_both_ways_on_a_tiny_ring_never_deadlocks_or_hits_rnr() {
        let mut p = Pair::symmetric(ChannelConfig {
            rx_slots: 4,
            max_queued: 4,
            ..ChannelConfig::default()
        });
        let n = 2000u64;
        let (mut sent, mut guard) = ([0u64; 2], 0u64);
        while sent[0] < n || sent[1] < n {
            for s in 0..2 {
                if sent[s] < n && p.send(s, data(8, sent[s] as u8)).is_ok() {
                    sent[s] += 1;
                }
            }
            if !p.step() {
                continue;
            }
            guard += 1;
            assert!(guard < 10_000_000, "no progress");
        }
        p.drive();
        for s in 0..2 {
            let r = &p.sides[1 - s].received;
            assert_eq!(r.len() as u64, n);
            assert!(r
                .iter()
                .enumerate()
                .all(|(i, (seq, _))| *seq == i as u64 + 1));
            assert_eq!(p.sides[s].completed.len() as u64, n);
        }
        assert_clean(&p);
    }

    #[test]
    fn one_send_in_signal_every_asks_for_a_completion_and_every_payload_comes_back() {
        for every in [1u32, 4, 16] {
            let mut p = Pair::symmetric(ChannelConfig {
                rx_slots: 8,
                max_queued: 8,
                sq_depth: 16,
                signal_every: every,
                ..ChannelConfig::default()
            });
            let n = 1000u64;
            for i in 0..n {
                // Ping-pong: each message waits for the one before it to come back.
                p.send(0, data(8, i as u8)).expect("accepted");
                p.drive();
                p.send(1, data(8, i as u8)).expect("accepted");
                p.drive();
            }
            for s in 0..2 {
                let side = &p.sides[s];
                assert_eq!(side.completed.len() as u64, n, "every {every}");
                assert_eq!(p.sides[1 - s].received.len() as u64, n);
                let (posted, signaled) = (side.sends_posted, side.signaled_sends);
                assert!(posted >= n, "every {every}: {posted} sends");
                // The harness holds an unsignaled SEND's send-queue entry until a later signaled
                // completion, and asserts the queue is never overrun.
                // At most half the send queue waits for a completion.
                let want = posted / u64::from(every.min(16 / 2));
                assert!(
                    signaled >= want && signaled <= want + 1,
                    "every {every}: {signaled} of {posted} SENDs signaled"
                );
            }
            assert_clean(&p);
        }
    }

    /// A receiver that leaves its reposts for later (the pass that delivers a message posts
    /// the reply first) withholds the credits of slots not posted yet: its reply returns no
    /// credit for them, so a sender that then spends every credit at once while the receiver
    /// is busy elsewhere never finds an unposted slot.
    #[test]
    fn credits_of_slots_waiting_to_be_reposted_are_withheld() {
        let cfg = ChannelConfig::default();
        let mut p = Pair::symmetric(cfg.clone());
        p.sides[1].always_defer = true;
        let mut sent = Vec::new();
        let mut send = |p: &mut Pair, len: usize, seed: u8| {
            let msg = data(len, seed);
            p.send(0, msg.clone()).expect("accepted");
            sent.push(msg);
        };
        for round in 0..20u8 {
            // A few messages whose slots then wait to be reposted, and a reply.
            for i in 0..(3 + round % 10) {
                send(&mut p, 24, round.wrapping_add(i));
            }
            p.drive();
            p.send(1, data(8, round)).expect("reply accepted");
            p.drive();
            assert!(
                p.sides[1].core.reposts_pending() > 0,
                "the receiver left its reposts"
            );
            // A busy receiver: the sender spends every credit it holds.
            p.sides[1].paused = true;
            for i in 0..p.sides[0].core.credits().min(cfg.max_queued) {
                send(&mut p, 16 + i as usize, round ^ 0x5a);
            }
            // (The paused side's ack timer keeps the pair from going idle: bounded steps.)
            for _ in 0..2_000 {
                if !p.step() {
                    break;
                }
            }
            p.sides[1].paused = false;
            p.drive();
        }
        let got: Vec<Vec<u8>> = p.sides[1]
            .received
            .iter()
            .map(|(_, g)| match g {
                Got::Bytes(b) => b.clone(),
                Got::Pattern(_) => panic!("no pattern sent"),
            })
            .collect();
        assert_eq!(got, sent);
        assert_clean(&p);
    }

    #[test]
    fn an_idle_channel_stops_sending_updates() {
        let mut p = Pair::symmetric(small_ring());
        for i in 0..100 {
            while p.send(0, data(16, i)).is_err() {
                p.step();
            }
        }
        p.drive();
        let updates = p.sides[0].core.stats().updates_sent + p.sides[1].core.stats().updates_sent;
        // Acks and credits for 100 messages on an 8-slot ring: a few dozen updates at most,
        // and `drive` returning at all shows they stop.
        assert!(updates <= 100, "{updates} lone updates for 100 messages");
        let before = p.steps;
        p.drive();
        assert!(p.steps - before <= 2, "an idle pair kept working");
        assert_clean(&p);
    }

    #[test]
    fn rendezvous_waits_for_a_buffer_then_completes() {
        let mut p = Pair::symmetric(ChannelConfig::default());
        p.sides[1].withhold_buffers = true;
        p.send(0, data(100_000, 4)).expect("accepted");
        p.send(0, data(10, 5)).expect("accepted");
        p.drive();
        // Order is kept: the eager message behind the rendezvous one waits too.
        assert!(p.sides[1].received.is_empty());
        p.sides[1].withhold_buffers = false;
        p.drive();
        assert_eq!(p.sides[1].received.len(), 2);
        assert_eq!(p.sides[1].received[0].1, Got::Bytes(data(100_000, 4)));
        assert_clean(&p);
    }

    /// A pull that finds no memory asks again by itself (the core's timeout), backing off,
    /// until memory comes back — with nothing else happening on the channel to wake it.
    #[test]
    fn a_pull_without_memory_asks_again_by_itself_backing_off() {
        use std::time::Duration;
        let mut p = Pair::symmetric(ChannelConfig::default());
        let until = p.now.saturating_add(Duration::from_millis(20));
        p.sides[1].no_memory_until = Some(until);
        p.send(0, data(100_000, 4)).expect("accepted");
        p.send(0, data(10, 5)).expect("accepted");
        p.drive();
        let got = &p.sides[1].received;
        assert!(
            got.len() == 2
                && got[0] == (1, Got::Bytes(data(100_000, 4)))
                && got[1] == (2, Got::Bytes(data(10, 5))),
            "both messages, in order, once memory came back ({} received)",
            got.len()
        );
        assert!(p.now >= until);
        // 100 µs doubling to 5 ms: about ten asks over 20 ms, not one every 100 µs.
        let asks = p.sides[1].memory_refusals;
        assert!((5..=20).contains(&asks), "{asks} asks for memory");
        // Memory found, the next shortage backs off from the start again: 250 µs without
        // memory cost little more than that (asks at 100 and 300 µs), not the 5 ms the last
        // shortage had reached.
        let start = p.now;
        p.sides[1].no_memory_until = Some(start.saturating_add(Duration::from_micros(250)));
        p.send(0, data(100_000, 6)).expect("accepted");
        p.drive();
        assert_eq!(p.sides[1].received.len(), 3);
        let took = Duration::from_nanos(p.now.as_nanos() - start.as_nanos());
        assert!(took < Duration::from_millis(2), "took {took:?}");
        assert_clean(&p);
    }
}

mod event_order {
    use super::*;

    /// A frame that delivers a message and acknowledges a send of this end yields the
    /// message first: a reader waiting for it is not held up by the sender's bookkeeping, and
    /// the completion can be taken alone later (`poll_send_complete`).
    #[test]
    fn an_arrival_comes_before_the_send_completions_its_frame_acknowledges() {
        use super::super::proto::Event;
        let cfg = ChannelConfig {
            signal_every: 1,
            ack_delay: std::time::Duration::from_secs(10),
            ..ChannelConfig::default()
        };
        let mut p = Pair::symmetric(cfg);
        p.send(0, data(8, 1)).expect("first message");
        while p.sides[1].received.is_empty() {
            assert!(p.step(), "the first message never arrived");
        }
        // The answer lands at end 0, which does not look at its events yet.
        p.sides[0].paused = true;
        p.send(1, data(8, 2)).expect("answer");
        for _ in 0..1000 {
            if !p.step() {
                break;
            }
        }
        let core = &mut p.sides[0].core;
        assert!(core.has_deliveries(), "the answer did not arrive");
        match core.poll_event() {
            Some(Event::Received { seq: 1, .. }) => {}
            other => panic!("expected the answer first, got {other:?}"),
        }
        assert!(!core.has_deliveries());
        match core.poll_send_complete() {
            Some(Event::SendComplete { id, .. }) => assert_eq!(id.0, 1),
            other => panic!("expected the first message's completion, got {other:?}"),
        }
        assert!(core.poll_event().is_none());
    }
}

mod slow_receiver {
    use super::*;

    #[test]
    fn sender_is_back_pressured_and_receiver_never_sees_rnr() {
        let mut p = Pair::symmetric(small_ring());
        p.sides[1].hold = true;
        let mut accepted = 0u64;
        let mut blocked = false;
        for i in 0..1000u32 {
            match p.send(0, data(64, i as u8)) {
                Ok(_) => accepted += 1,
                Err(ChannelError::WouldBlock) => {
                    blocked = true;
                    break;
                }
                Err(e) => panic!("unexpected {e}"),
            }
            p.drive();
        }
        assert!(blocked, "the sender was never back-pressured");
        // Ring of 8 slots, queue of 8: the receiver holds what it was lent, the rest waits.
        assert!(accepted <= 8 + 8, "accepted {accepted}");
        assert_eq!(p.sides[1].rnr_events, 0);
        // The receiver catches up: everything flows, the sender hears it may queue again.
        while p.sides[1].held > 0 {
            p.sides[1].release(u64::MAX);
            p.drive();
        }
        assert_eq!(p.sides[1].received.len() as u64, accepted);
        assert!(p.sides[0].writable_events >= 1);
        p.send(0, data(64, 1)).expect("room again");
        p.sides[1].hold = false;
        p.drive();
        assert_clean(&p);
    }

    /// A connecting side makes its end (and posts its ring) before the peer's hello-ack says
    /// how large the peer's ring is: the geometry set afterwards, not the one it was made
    /// with, bounds what it sends.
    #[test]
    fn a_peer_ring_learnt_after_the_end_was_made_bounds_the_first_burst() {
        let big = ChannelConfig {
            rx_slots: 16,
            max_queued: 32,
            ..ChannelConfig::default()
        };
        let mut p = Pair::new(big.clone(), small_ring());
        let own = big.ring_geometry();
        let peer = small_ring().ring_geometry();
        p.sides[0].core = ChannelCore::new(big, own).expect("valid");
        p.sides[0].core.set_peer(peer).expect("before any message");
        assert_eq!(p.sides[0].core.credits(), peer.rx_slots);
        p.sides[1].hold = true;
        let mut accepted = 0u64;
        while p.send(0, data(64, accepted as u8)).is_ok() {
            accepted += 1;
            p.drive();
        }
        assert!(
            accepted > 8,
            "the sender queued beyond the ring: {accepted}"
        );
        assert_eq!(
            p.sides[1].rnr_events, 0,
            "sent more than the peer's ring holds"
        );
        assert_eq!(p.sides[1].received.len(), 8, "the held ring is full");
        while p.sides[1].held > 0 {
            p.sides[1].release(u64::MAX);
            p.drive();
        }
        assert_eq!(p.sides[1].received.len() as u64, accepted);
        assert_clean(&p);
    }

    #[test]
    fn the_peer_ring_changes_only_before_the_first_message() {
        let mut p = Pair::symmetric(small_ring());
        let geo = PeerGeometry {
            rx_slots: 6,
            rx_slot_size: small_ring().rx_slot_size,
        };
        let tiny = PeerGeometry { rx_slots: 2, ..geo };
        assert!(matches!(
            p.sides[0].core.set_peer(tiny),
            Err(ChannelError::InvalidConfig(_))
        ));
        p.send(0, data(8, 1)).expect("accepted");
        assert!(matches!(
            p.sides[0].core.set_peer(geo),
            Err(ChannelError::InvalidConfig(_))
        ));
        // The side that has only received may not change it either.
        p.drive();
        assert!(matches!(
            p.sides[1].core.set_peer(geo),
            Err(ChannelError::InvalidConfig(_))
        ));
        assert_clean(&p);
    }
}

mod peer_input {
    use super::*;

    fn deliver_raw(p: &mut Pair, to: usize, bytes: &[u8]) {
        p.inject_frame(to, bytes);
    }

    fn frame(kind: MsgKind, seq: u32, body: FrameBody<'_>, payload: &[u8]) -> Vec<u8> {
        let len = match body {
            FrameBody::Rts(_) => wire::RTS_BODY_LEN as u32,
            FrameBody::Fin { .. } => wire::FIN_BODY_LEN as u32,
            _ => payload.len() as u32,
        };
        let h = MsgHeader {
            seq,
            ack: 0,
            credits: 0,
            kind,
            len,
            stream: 0,
            stream_credits: 0,
        };
        let mut v = HeadBuf::encode(&TraceHeader::default(), &h, &body)
            .as_slice()
            .to_vec();
        v.extend_from_slice(payload);
        v
    }

    #[test]
    fn replayed_message_is_dropped_as_duplicate() {
        let mut p = Pair::symmetric(ChannelConfig::default());
        p.send(0, data(10, 1)).expect("accepted");
        p.drive();
        let dup = frame(MsgKind::Data, 1, FrameBody::Data(&[]), &data(10, 1));
        deliver_raw(&mut p, 1, &dup);
        p.drive();
        assert_eq!(p.sides[1].received.len(), 1);
        assert_eq!(p.sides[1].core.stats().duplicates_dropped, 1);
        assert!(p.sides[1].errors.is_empty());
    }

    #[test]
    fn gap_in_sequence_closes_the_channel() {
        let mut p = Pair::symmetric(ChannelConfig::default());
        deliver_raw(
            &mut p,
            1,
            &frame(MsgKind::Data, 5, FrameBody::Data(&[]), b"x"),
        );
        p.drive();
        assert!(matches!(p.sides[1].errors[..], [ChannelError::Protocol(_)]));
        assert!(p.sides[1].core.is_failed());
    }

    #[test]
    fn garbage_closes_the_channel_with_a_decode_error() {
        let mut p = Pair::symmetric(ChannelConfig::default());
        deliver_raw(&mut p, 1, &[0xAB; 40]);
        p.drive();
        assert!(matches!(p.sides[1].errors[..], [ChannelError::Decode(_)]));
    }

    #[test]
    fn oversized_rendezvous_is_refused() {
        let mut p = Pair::symmetric(ChannelConfig {
            max_message_len: 1 << 20,
            ..ChannelConfig::default()
        });
        let rts = wire::Rts {
            total_len: 1 << 40,
            source: RemoteAddr {
                addr: 0,
                rkey: Rkey(1),
            },
        };
        deliver_raw(&mut p, 1, &frame(MsgKind::Rts, 1, FrameBody::Rts(rts), &[]));
        p.drive();
        assert!(matches!(p.sides[1].errors[..], [ChannelError::Protocol(_)]));
    }

    #[test]
    fn message_above_the_local_limit_is_refused_at_send() {
        let mut p = Pair::symmetric(ChannelConfig {
            max_message_len: 100,
            ..ChannelConfig::default()
        });
        assert!(matches!(
            p.send(0, data(101, 0)),
            Err(ChannelError::MessageTooLarge { len: 101, max: 100 })
        ));
    }

    proptest! {
        #[test]
        fn arbitrary_slot_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..128)) {
            let mut p = Pair::symmetric(ChannelConfig::default());
            deliver_raw(&mut p, 1, &bytes);
            p.drive();
        }
    }
}

mod failing_qp {
    use super::*;

    #[test]
    fn failed_send_completion_fails_the_channel_once() {
        let mut p = Pair::symmetric(ChannelConfig::default());
        p.sides[0].inject(WcOpcode::Send, WcStatus::RetryExceeded);
        p.send(0, data(10, 0)).expect("accepted");
        p.drive();
        assert!(matches!(
            p.sides[0].errors[..],
            [ChannelError::Completion {
                status: WcStatus::RetryExceeded,
                ..
            }]
        ));
        assert!(matches!(p.send(0, data(1, 0)), Err(ChannelError::Closed)));
    }

    #[test]
    fn failed_read_fails_the_receiving_end() {
        let mut p = Pair::symmetric(ChannelConfig::default());
        p.sides[1].inject(WcOpcode::RdmaRead, WcStatus::RemoteAccess);
        p.send(0, data(200_000, 0)).expect("accepted");
        p.drive();
        assert!(matches!(
            p.sides[1].errors[..],
            [ChannelError::Completion {
                status: WcStatus::RemoteAccess,
                ..
            }]
        ));
        assert!(p.sides[1].received.is_empty());
    }

    /// A rendezvous payload whose drop is seen.
    struct Tracked {
        len: u64,
        dropped: std::rc::Rc<std::cell::Cell<bool>>,
    }

    impl Drop for Tracked {
        fn drop(&mut self) {
            self.dropped.set(true);
        }
    }

    impl super::super::proto::OutPayload for Tracked {
        fn len(&self) -> u64 {
            self.len
        }
        fn sge(&self) -> Option<fabriq_verbs::Sge> {
            Some(fabriq_verbs::Sge {
                addr: 1 << 40,
                length: u32::try_from(self.len).ok()?,
                lkey: fabriq_verbs::Lkey(1),
            })
        }
        fn remote(&self) -> Option<RemoteAddr> {
            Some(RemoteAddr {
                addr: 1 << 40,
                rkey: Rkey(1),
            })
        }
    }

    /// A failure ends a channel whose rendezvous message the peer may be pulling: the core
    /// keeps the message's buffer until it is dropped itself (which its owner does after
    /// stopping and draining the QP), not a moment before — given back at the failure, it
    /// could carry another message while the peer still reads it.
    #[test]
    fn a_failed_core_keeps_a_sent_buffer_the_peer_may_still_read() {
        let cfg = ChannelConfig::default();
        let mut core: ChannelCore<Tracked, super::super::harness::TestIn> =
            ChannelCore::new(cfg.clone(), cfg.ring_geometry()).expect("core");
        let dropped = std::rc::Rc::new(std::cell::Cell::new(false));
        let len = 4 * u64::from(cfg.thresholds.eager_max);
        let payload = Tracked {
            len,
            dropped: std::rc::Rc::clone(&dropped),
        };
        core.send(payload, Default::default())
            .map_err(|(e, _)| e)
            .expect("send");
        let now = super::super::proto::Instant::from_nanos(1);
        let mut sends = 0;
        while let Some(wr) = core.poll_work_request(now) {
            if let super::super::proto::WorkRequest::Send { payload, .. } = wr {
                assert!(payload.is_none(), "a rendezvous message goes as an RTS");
                sends += 1;
            }
        }
        assert_eq!(sends, 1, "the RTS went out");
        core.handle_fatal(ChannelError::Closed);
        while core.poll_event().is_some() {}
        assert!(!dropped.get(), "the buffer went back at the failure");
        drop(core);
        assert!(dropped.get(), "the buffer goes back with the core");
    }
}

#[derive(Debug, Clone)]
enum Op {
    Send { from: usize, len: usize },
    Step(u8),
    SetEager(u32),
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let cfg = ChannelConfig::default();
    let e = cfg.thresholds.eager_max as usize;
    let c = cfg.thresholds.chunk_size as usize;
    let size = prop_oneof![
        0usize..64,
        (e - 8)..(e + 8),
        (c - 8)..(c + 8),
        (2 * c - 4)..(2 * c + 4),
        1usize..(3 * c),
    ];
    prop_oneof![
        4 => (0usize..2, size).prop_map(|(from, len)| Op::Send { from, len }),
        3 => (1u8..40).prop_map(Op::Step),
        1 => prop_oneof![Just(1024u32), Just(2048), Just(4096), Just(8192)].prop_map(Op::SetEager),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn random_interleavings_deliver_every_byte_once_in_order(
        ops in proptest::collection::vec(op_strategy(), 1..60),
        slots in 4u32..12,
        sq_depth in 4u32..40,
        signal_every in 1u32..24,
    ) {
        let mut p = Pair::symmetric(ChannelConfig {
            rx_slots: slots,
            max_queued: slots,
            sq_depth,
            signal_every,
            ..ChannelConfig::default()
        });
        let mut expected: [Vec<Vec<u8>>; 2] = [Vec::new(), Vec::new()];
        for (i, op) in ops.iter().enumerate() {
            match *op {
                Op::Send { from, len } => {
                    let d = data(len, i as u8);
                    let mut tries = 0;
                    loop {
                        match p.send(from, d.clone()) {
                            Ok(_) => break,
                            Err(ChannelError::WouldBlock) => {
                                tries += 1;
                                prop_assert!(tries < 1_000_000);
                                p.step();
                            }
                            Err(e) => prop_assert!(false, "send failed: {}", e),
                        }
                    }
                    expected[from].push(d);
                }
                Op::Step(n) => for _ in 0..n { p.step(); },
                Op::SetEager(e) => {
                    let mut t = Thresholds::default();
                    t.eager_max = e;
                    p.sides[i % 2].core.set_thresholds(t).expect("valid");
                }
            }
        }
        p.drive();
        for from in 0..2 {
            let got = &p.sides[1 - from].received;
            prop_assert_eq!(got.len(), expected[from].len());
            for (k, (seq, g)) in got.iter().enumerate() {
                prop_assert_eq!(*seq, k as u64 + 1);
                prop_assert_eq!(g, &Got::Bytes(expected[from][k].clone()));
            }
            prop_assert_eq!(p.sides[from].completed.len(), expected[from].len());
            prop_assert!(p.sides[from].errors.is_empty());
            prop_assert_eq!(p.sides[from].rnr_events, 0);
        }
    }
}
