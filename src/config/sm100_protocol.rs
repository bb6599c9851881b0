//! The SM100 (FlashAttention-4) forward kernel's pipeline protocol, as data, and a CPU model
//! that runs it.
//!
//! The kernel that [`FA4Config`] plans is five roles (two softmax warpgroups, the correction
//! warpgroup, one MMA warp and one TMA warp) and two engines that work behind them (the tensor
//! pipe, which runs `tcgen05.mma` in issue order and arrives on a barrier at `tcgen05.commit`
//! once everything issued before it is done, and the TMA engine, which fills shared memory and
//! counts the bytes on a barrier). They synchronise only through mbarriers. [`Protocol`] lists
//! those barriers (producer, consumer, arrivals per phase, transaction bytes) from the plan, and
//! [`Protocol::programs`] writes each role's sequence of barrier and buffer operations for a
//! CTA that walks `n` key blocks. The kernel generator emits the barrier table into the kernel's
//! prelude from the same description ([`Protocol::prelude`]).
//!
//! [`Protocol::simulate`] runs the programs as state machines under a scheduler (random, or
//! adversarial: one actor starved until nothing else can move) with mbarrier semantics (phase
//! parity waits, pending arrivals, transaction bytes) and checks, step by step:
//! - no role waits forever (a deadlock names every role's pending operation);
//! - no barrier gets more arrivals than its count in a phase, or more bytes than expected, and at
//!   the end every barrier is at a phase boundary with no bytes outstanding;
//! - a parity wait never passes on a phase older than the one the role means (the aliasing a
//!   consumer two phases behind would suffer);
//! - every read finds the value it expects in its buffer (shared-memory slot, TMEM region):
//!   a buffer overwritten before its consumer released it, or read before it was written, fails.
//!
//! Tests mutate the protocol (one arrival too few, a release left out, a release at issue time
//! instead of at the commit, a missing acquire before overwriting the correction factor) and
//! check that the model fails each. The schedule follows FlashAttention-4's (the MMA warp keeps
//! two MMAs between each S and its use as P) with the two races fixed upstream: K/V slots are
//! released by `tcgen05.commit`, not by a plain arrive at issue, and the softmax acquires the
//! correction slot before overwriting it.

use std::fmt;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::sm100::FA4Config;

/// Who runs an operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Softmax warpgroup of Q tile 0 (rows 0–127), and its epilogue.
    Softmax0,
    /// Softmax warpgroup of Q tile 1.
    Softmax1,
    /// The correction warpgroup: rescales O in TMEM when a row max changes.
    Correction,
    /// The warp that issues `tcgen05.mma` and `tcgen05.commit`.
    Mma,
    /// The warp that issues TMA loads of Q, K and V.
    Load,
}

impl Role {
    /// Every role, in warp order.
    pub const ALL: [Role; 5] = [
        Role::Softmax0,
        Role::Softmax1,
        Role::Correction,
        Role::Mma,
        Role::Load,
    ];

    fn softmax(tile: usize) -> Role {
        if tile == 0 {
            Role::Softmax0
        } else {
            Role::Softmax1
        }
    }
}

/// Who arrives on a barrier (the producer of a phase) or waits on it (the consumer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Party {
    /// A role's threads arrive or wait.
    Role(Role),
    /// The tensor pipe arrives through `tcgen05.commit` issued by the MMA warp.
    Commit,
    /// The TMA engine completes transaction bytes (the loader arrives with `expect_tx`).
    Tma,
}

/// One mbarrier of the protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BarrierSpec {
    /// Name, as the kernel's barrier enum spells it.
    pub name: String,
    /// Who completes a phase.
    pub producer: Party,
    /// Who waits for a phase.
    pub consumer: Role,
    /// Arrivals that complete a phase (the init count).
    pub arrivals: u32,
    /// Transaction bytes per phase (0 for barriers without TMA), the largest a phase expects.
    pub tx_bytes: u64,
    /// What a completed phase means.
    pub what: &'static str,
}

/// A buffer the model tracks: a shared-memory tile or a TMEM region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Buf {
    /// Shared-memory Q tile `i`; the epilogue of tile `i` reuses it to stage O.
    Q(usize),
    /// K/V ring slot.
    Kv(usize),
    /// TMEM S/P region of tile `i` (P is written in place over S).
    S(usize),
    /// TMEM correction column of tile `i`.
    C(usize),
    /// TMEM O accumulator of tile `i`.
    O(usize),
}

/// What a buffer holds: a kind and the key block it belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Val {
    /// Q tile `i`.
    Q(usize),
    /// K block `n`.
    K(usize),
    /// V block `n`.
    V(usize),
    /// Scores of tile `i` and block `n`.
    S(usize, usize),
    /// Probabilities of tile `i` and block `n` (over S).
    P(usize, usize),
    /// Correction factor of tile `i` for block `n`.
    C(usize, usize),
    /// O of tile `i` after block `n`'s P·V.
    O(usize, usize),
    /// O of tile `i` after block `n - 1`, rescaled for block `n`.
    Rescaled(usize, usize),
    /// The output of tile `i`, staged in its Q tile.
    Out(usize),
}

/// One step of a role's program.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Wait until phase `phase` (0-based count of completions, −1 = the producer's start) of
    /// `bar` completed, by its parity as `mbarrier.try_wait.parity` does.
    Wait {
        /// Barrier index.
        bar: usize,
        /// Phase waited for.
        phase: i64,
    },
    /// `count` arrivals (a warpgroup's 128 threads arrive as 128).
    Arrive {
        /// Barrier index.
        bar: usize,
        /// Arrivals.
        count: u32,
    },
    /// One arrival that also expects `bytes` (`mbarrier.arrive.expect_tx`).
    ArriveExpectTx {
        /// Barrier index.
        bar: usize,
        /// Bytes the phase waits for.
        bytes: u64,
    },
    /// A TMA load: the engine writes `val` into `buf` and completes `bytes` on `bar`, later.
    Tma {
        /// Barrier index.
        bar: usize,
        /// Destination.
        buf: Buf,
        /// What lands.
        val: Val,
        /// Bytes counted.
        bytes: u64,
    },
    /// A `tcgen05.mma`: the tensor pipe reads `reads` and writes `write`, in issue order.
    Mma {
        /// Operands and what each must hold.
        reads: Vec<(Buf, Val)>,
        /// The accumulator and what it holds after.
        write: (Buf, Val),
    },
    /// `tcgen05.commit`: one arrival on `bar` once every MMA issued before it is done.
    Commit {
        /// Barrier index.
        bar: usize,
    },
    /// A role reads a buffer directly (`tcgen05.ld`, a shared-memory load).
    Read {
        /// Buffer.
        buf: Buf,
        /// What it must hold.
        val: Val,
    },
    /// A role writes a buffer directly (`tcgen05.st`, `st.matrix`).
    Write {
        /// Buffer.
        buf: Buf,
        /// What it holds after.
        val: Val,
    },
}

/// A change to the protocol, for the tests that check the model catches broken protocols.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mutation {
    /// Softmax tile 0 arrives one thread short on its S-consumer barrier.
    OneArrivalShort,
    /// The MMA warp never releases K slots.
    MissingKRelease,
    /// The MMA warp releases K/V slots with a plain arrive at issue time, not by commit
    /// (FlashAttention-4's race before its 2025-11-19 fix).
    ReleaseAtIssue,
    /// The softmax overwrites the correction factor without acquiring it (upstream added the
    /// acquire on 2025-11-17). In this schedule the O pipeline already orders the two: the
    /// model passes without it (a test says so), and the kernel keeps it.
    NoCorrectionAcquire,
    /// The softmax releases S before it has written P over it.
    EarlyPRelease,
    /// The loader expects only the K tile's bytes on the barrier that Q0 shares with K0.
    Q0BytesNotExpected,
}

/// The protocol of one planned SM100 kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Protocol {
    /// Every barrier, in the order of their shared-memory slots.
    pub barriers: Vec<BarrierSpec>,
    /// K/V ring slots (`num_kv_stages`).
    pub kv_stages: usize,
    /// Bytes of one K or V tile (`BN · pd · s`).
    pub kv_tile_bytes: u64,
    /// Bytes of one Q tile (`BM / 2 · pd · s`).
    pub q_tile_bytes: u64,
    mutation: Option<Mutation>,
}

/// Threads of a warpgroup, the arrivals of a warpgroup-wide arrive.
pub const WARPGROUP: u32 = 128;

// Fixed barrier slots (the 11 "misc" and 4 O-pipeline barriers of the plan's budget); the K/V
// ring's follow: full[s] at KV_BASE + s, empty[s] at KV_BASE + stages + s.
const S_FULL: [usize; 2] = [0, 2];
const S_EMPTY: [usize; 2] = [1, 3];
const C_FULL: [usize; 2] = [4, 6];
const C_EMPTY: [usize; 2] = [5, 7];
// 8, 9: the two softmax-order barriers (in the budget, unused by this schedule).
const Q1_FULL: usize = 10;
const O_FULL: [usize; 2] = [11, 12];
const O_EMPTY: [usize; 2] = [13, 14];
const KV_BASE: usize = 15;

impl Protocol {
    /// The protocol of the kernel `cfg` plans.
    pub fn new(cfg: &FA4Config) -> Protocol {
        let kv_stages = cfg.num_kv_stages() as usize;
        let kv_tile_bytes = cfg.bn() * cfg.padded_depth() * cfg.dtype_size();
        let q_tile_bytes = cfg.bm() / 2 * cfg.padded_depth() * cfg.dtype_size();
        let sm = |t: usize| Role::softmax(t);
        let mut barriers = Vec::new();
        let mut push = |name: String, producer, consumer, arrivals, tx_bytes, what| {
            barriers.push(BarrierSpec {
                name,
                producer,
                consumer,
                arrivals,
                tx_bytes,
                what,
            })
        };
        for t in 0..2 {
            push(
                format!("s{t}_full"),
                Party::Commit,
                sm(t),
                1,
                0,
                "S = Q·Kᵀ is in TMEM",
            );
            push(
                format!("s{t}_empty"),
                Party::Role(sm(t)),
                Role::Mma,
                WARPGROUP,
                0,
                "P is written over S",
            );
        }
        for t in 0..2 {
            push(
                format!("c{t}_full"),
                Party::Role(sm(t)),
                Role::Correction,
                WARPGROUP,
                0,
                "the correction factor is in TMEM",
            );
            push(
                format!("c{t}_empty"),
                Party::Role(Role::Correction),
                sm(t),
                WARPGROUP,
                0,
                "the correction factor was read",
            );
        }
        for t in 0..2 {
            push(
                format!("order{t}"),
                Party::Role(sm(t)),
                sm(1 - t),
                WARPGROUP,
                0,
                "softmax ordering (allocated by the plan, unused)",
            );
        }
        push(
            "q1_full".into(),
            Party::Tma,
            Role::Mma,
            1,
            q_tile_bytes,
            "Q tile 1 landed",
        );
        for t in 0..2 {
            push(
                format!("o{t}_full"),
                Party::Commit,
                Role::Correction,
                1,
                0,
                "O += P·V done",
            );
        }
        for t in 0..2 {
            push(
                format!("o{t}_empty"),
                Party::Role(Role::Correction),
                Role::Mma,
                WARPGROUP,
                0,
                "O rescaled for the next P·V",
            );
        }
        for s in 0..kv_stages {
            let bytes = if s == 0 {
                kv_tile_bytes + q_tile_bytes
            } else {
                kv_tile_bytes
            };
            push(
                format!("kv{s}_full"),
                Party::Tma,
                Role::Mma,
                1,
                bytes,
                "K or V tile landed",
            );
        }
        for s in 0..kv_stages {
            push(
                format!("kv{s}_empty"),
                Party::Commit,
                Role::Load,
                1,
                0,
                "the MMAs reading the slot are done",
            );
        }
        Protocol {
            barriers,
            kv_stages,
            kv_tile_bytes,
            q_tile_bytes,
            mutation: None,
        }
    }

    /// The same protocol with one deliberate defect.
    pub fn mutated(mut self, m: Mutation) -> Protocol {
        self.mutation = Some(m);
        self
    }

    /// Shared-memory bytes of the barriers (8 each): the plan's misc, O-pipeline and K/V-ring
    /// barrier items together.
    pub fn barrier_bytes(&self) -> u64 {
        self.barriers.len() as u64 * FA4Config::MBAR_SIZE
    }

    fn kv_full(&self, s: usize) -> usize {
        KV_BASE + s
    }

    fn kv_empty(&self, s: usize) -> usize {
        KV_BASE + self.kv_stages + s
    }

    /// The ring position's slot and how many times the slot was used before it.
    fn ring(&self, pos: usize) -> (usize, i64) {
        (pos % self.kv_stages, (pos / self.kv_stages) as i64)
    }

    /// The kernel-side table: barrier ids and init counts, for the generated prelude.
    pub fn prelude(&self) -> String {
        let mut s =
            String::from("// mbarriers of the FA4 pipeline (generated from the protocol)\n");
        s += "enum Bar : int {\n";
        for (i, b) in self.barriers.iter().enumerate() {
            s += &format!("  BAR_{} = {i},\n", b.name.to_uppercase());
        }
        s += &format!("  BAR_COUNT = {}\n}};\n", self.barriers.len());
        s += "__device__ constexpr unsigned BAR_ARRIVALS[BAR_COUNT] = {";
        s += &self
            .barriers
            .iter()
            .map(|b| b.arrivals.to_string())
            .collect::<Vec<_>>()
            .join(", ");
        s += "};\n";
        s += &format!(
            "constexpr unsigned KV_TILE_BYTES = {};\nconstexpr unsigned Q_TILE_BYTES = {};\n",
            self.kv_tile_bytes, self.q_tile_bytes
        );
        s
    }

    /// Each role's program for a CTA that walks `n` key blocks (the mask scan gives every role
    /// the same `n`; fully masked blocks are skipped by all of them alike).
    pub fn programs(&self, n: usize) -> Vec<(Role, Vec<Op>)> {
        vec![
            (Role::Softmax0, self.softmax(0, n)),
            (Role::Softmax1, self.softmax(1, n)),
            (Role::Correction, self.correction(n)),
            (Role::Mma, self.mma(n)),
            (Role::Load, self.load(n)),
        ]
    }

    fn load(&self, n: usize) -> Vec<Op> {
        let mut ops = Vec::new();
        if n == 0 {
            return ops;
        }
        // Ring positions: K_j at 2j, V_j at 2j + 1. Q0 rides on K0's barrier, Q1 on its own.
        let load_kv = |ops: &mut Vec<Op>, pos: usize, val: Val, with_q0: bool| {
            let (s, uses) = self.ring(pos);
            ops.push(Op::Wait {
                bar: self.kv_empty(s),
                phase: uses - 1,
            });
            let q0_short = self.mutation == Some(Mutation::Q0BytesNotExpected);
            let expect = if with_q0 && !q0_short {
                self.kv_tile_bytes + self.q_tile_bytes
            } else {
                self.kv_tile_bytes
            };
            let bar = self.kv_full(s);
            ops.push(Op::ArriveExpectTx { bar, bytes: expect });
            if with_q0 {
                ops.push(Op::Tma {
                    bar,
                    buf: Buf::Q(0),
                    val: Val::Q(0),
                    bytes: self.q_tile_bytes,
                });
            }
            ops.push(Op::Tma {
                bar,
                buf: Buf::Kv(s),
                val,
                bytes: self.kv_tile_bytes,
            });
        };
        load_kv(&mut ops, 0, Val::K(0), true);
        ops.push(Op::ArriveExpectTx {
            bar: Q1_FULL,
            bytes: self.q_tile_bytes,
        });
        ops.push(Op::Tma {
            bar: Q1_FULL,
            buf: Buf::Q(1),
            val: Val::Q(1),
            bytes: self.q_tile_bytes,
        });
        load_kv(&mut ops, 1, Val::V(0), false);
        for j in 1..n {
            load_kv(&mut ops, 2 * j, Val::K(j), false);
            load_kv(&mut ops, 2 * j + 1, Val::V(j), false);
        }
        ops
    }

    fn mma(&self, n: usize) -> Vec<Op> {
        let mut ops = Vec::new();
        if n == 0 {
            return ops;
        }
        let at_issue = self.mutation == Some(Mutation::ReleaseAtIssue);
        let release = |ops: &mut Vec<Op>, pos: usize, is_k: bool| {
            if is_k && self.mutation == Some(Mutation::MissingKRelease) {
                return;
            }
            let bar = self.kv_empty(self.ring(pos).0);
            ops.push(if at_issue {
                Op::Arrive { bar, count: 1 }
            } else {
                Op::Commit { bar }
            });
        };
        let acquire = |ops: &mut Vec<Op>, pos: usize| {
            let (s, uses) = self.ring(pos);
            ops.push(Op::Wait {
                bar: self.kv_full(s),
                phase: uses,
            });
        };
        let slot = |pos: usize| Buf::Kv(self.ring(pos).0);
        let qk = |ops: &mut Vec<Op>, t: usize, j: usize| {
            ops.push(Op::Mma {
                reads: vec![(Buf::Q(t), Val::Q(t)), (slot(2 * j), Val::K(j))],
                write: (Buf::S(t), Val::S(t, j)),
            });
            ops.push(Op::Commit { bar: S_FULL[t] });
        };
        // O_t += P_t·V_j: needs P written (S-empty phase j) and, after the first block, O
        // rescaled by the correction warpgroup (O-empty phase j − 1).
        let pv = |ops: &mut Vec<Op>, t: usize, j: usize| {
            ops.push(Op::Wait {
                bar: S_EMPTY[t],
                phase: j as i64,
            });
            let mut reads = vec![(Buf::S(t), Val::P(t, j)), (slot(2 * j + 1), Val::V(j))];
            if j > 0 {
                ops.push(Op::Wait {
                    bar: O_EMPTY[t],
                    phase: j as i64 - 1,
                });
                reads.push((Buf::O(t), Val::Rescaled(t, j)));
            }
            ops.push(Op::Mma {
                reads,
                write: (Buf::O(t), Val::O(t, j)),
            });
            ops.push(Op::Commit { bar: O_FULL[t] });
        };
        acquire(&mut ops, 0);
        qk(&mut ops, 0, 0);
        ops.push(Op::Wait {
            bar: Q1_FULL,
            phase: 0,
        });
        qk(&mut ops, 1, 0);
        release(&mut ops, 0, true);
        acquire(&mut ops, 1);
        pv(&mut ops, 0, 0);
        for j in 1..n {
            acquire(&mut ops, 2 * j);
            qk(&mut ops, 0, j);
            pv(&mut ops, 1, j - 1);
            release(&mut ops, 2 * (j - 1) + 1, false);
            qk(&mut ops, 1, j);
            release(&mut ops, 2 * j, true);
            acquire(&mut ops, 2 * j + 1);
            pv(&mut ops, 0, j);
        }
        pv(&mut ops, 1, n - 1);
        release(&mut ops, 2 * (n - 1) + 1, false);
        ops
    }

    fn softmax(&self, t: usize, n: usize) -> Vec<Op> {
        let mut ops = Vec::new();
        for j in 0..n {
            ops.push(Op::Wait {
                bar: S_FULL[t],
                phase: j as i64,
            });
            ops.push(Op::Read {
                buf: Buf::S(t),
                val: Val::S(t, j),
            });
            if j > 0 {
                if self.mutation != Some(Mutation::NoCorrectionAcquire) {
                    ops.push(Op::Wait {
                        bar: C_EMPTY[t],
                        phase: j as i64 - 2,
                    });
                }
                ops.push(Op::Write {
                    buf: Buf::C(t),
                    val: Val::C(t, j),
                });
                ops.push(Op::Arrive {
                    bar: C_FULL[t],
                    count: WARPGROUP,
                });
            }
            let short = t == 0 && self.mutation == Some(Mutation::OneArrivalShort);
            let mut write_p = Op::Write {
                buf: Buf::S(t),
                val: Val::P(t, j),
            };
            let mut release = Op::Arrive {
                bar: S_EMPTY[t],
                count: WARPGROUP - u32::from(short),
            };
            if self.mutation == Some(Mutation::EarlyPRelease) {
                std::mem::swap(&mut write_p, &mut release);
            }
            ops.push(write_p);
            ops.push(release);
        }
        // Epilogue: the last P·V done, O staged in the Q tile's shared memory. Without keys
        // the rows are written as 0 without touching TMEM.
        if n > 0 {
            ops.push(Op::Wait {
                bar: O_FULL[t],
                phase: n as i64 - 1,
            });
            ops.push(Op::Read {
                buf: Buf::O(t),
                val: Val::O(t, n - 1),
            });
        }
        ops.push(Op::Write {
            buf: Buf::Q(t),
            val: Val::Out(t),
        });
        ops
    }

    fn correction(&self, n: usize) -> Vec<Op> {
        let mut ops = Vec::new();
        for j in 1..n {
            for t in 0..2 {
                ops.push(Op::Wait {
                    bar: C_FULL[t],
                    phase: j as i64 - 1,
                });
                ops.push(Op::Read {
                    buf: Buf::C(t),
                    val: Val::C(t, j),
                });
                ops.push(Op::Arrive {
                    bar: C_EMPTY[t],
                    count: WARPGROUP,
                });
                ops.push(Op::Wait {
                    bar: O_FULL[t],
                    phase: j as i64 - 1,
                });
                ops.push(Op::Read {
                    buf: Buf::O(t),
                    val: Val::O(t, j - 1),
                });
                ops.push(Op::Write {
                    buf: Buf::O(t),
                    val: Val::Rescaled(t, j),
                });
                ops.push(Op::Arrive {
                    bar: O_EMPTY[t],
                    count: WARPGROUP,
                });
            }
        }
        ops
    }

    /// Runs the programs for `n` key blocks under `policy` and checks the protocol.
    pub fn simulate(&self, n: usize, policy: Policy) -> Result<Stats, Violation> {
        Sim::new(self, n, policy).run()
    }
}

/// How the model's scheduler picks the next actor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Uniformly among the actors that can move, from a seed.
    Random(u64),
    /// Randomly, but `Actor` moves only when nothing else can (a slow consumer or engine).
    Starve(Actor, u64),
}

/// A role or one of the engines behind the roles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Actor {
    /// A warp role.
    Role(Role),
    /// The tensor pipe (MMAs and commits, in issue order).
    TensorPipe,
    /// The TMA engine (loads complete in any order).
    Tma,
}

/// What one simulation did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Stats {
    /// Operations executed.
    pub steps: usize,
    /// Barrier phases completed.
    pub phases: u64,
}

/// A protocol defect the model found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation(pub String);

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[derive(Debug, Clone)]
struct BarState {
    pending: i64,
    tx: i64,
    completed: i64,
}

enum Queued {
    Mma {
        reads: Vec<(Buf, Val)>,
        write: (Buf, Val),
    },
    Commit(usize),
    Tma {
        bar: usize,
        buf: Buf,
        val: Val,
        bytes: u64,
    },
}

struct Sim<'a> {
    proto: &'a Protocol,
    programs: Vec<(Role, Vec<Op>)>,
    pc: Vec<usize>,
    bars: Vec<BarState>,
    bufs: std::collections::HashMap<Buf, Val>,
    pipe: std::collections::VecDeque<Queued>,
    tma: Vec<Queued>,
    rng: StdRng,
    starved: Option<Actor>,
    stats: Stats,
}

impl<'a> Sim<'a> {
    fn new(proto: &'a Protocol, n: usize, policy: Policy) -> Sim<'a> {
        let (seed, starved) = match policy {
            Policy::Random(s) => (s, None),
            Policy::Starve(a, s) => (s, Some(a)),
        };
        let programs = proto.programs(n);
        Sim {
            proto,
            pc: vec![0; programs.len()],
            programs,
            bars: proto
                .barriers
                .iter()
                .map(|b| BarState {
                    pending: i64::from(b.arrivals),
                    tx: 0,
                    completed: 0,
                })
                .collect(),
            bufs: Default::default(),
            pipe: Default::default(),
            tma: Vec::new(),
            rng: StdRng::seed_from_u64(seed),
            starved,
            stats: Stats::default(),
        }
    }

    fn name(&self, bar: usize) -> &str {
        &self.proto.barriers[bar].name
    }

    /// Whether role `r`'s next operation can run now.
    fn ready(&self, r: usize) -> bool {
        match self.programs[r].1.get(self.pc[r]) {
            None => false,
            Some(Op::Wait { bar, phase }) => {
                // try_wait.parity(p) passes once the phase of parity p is complete: the
                // barrier's current (incomplete) phase has the other parity.
                (self.bars[*bar].completed & 1) != phase.rem_euclid(2)
            }
            Some(_) => true,
        }
    }

    fn actors(&self) -> Vec<Actor> {
        let mut a: Vec<Actor> = (0..self.programs.len())
            .filter(|&r| self.ready(r))
            .map(|r| Actor::Role(self.programs[r].0))
            .collect();
        if !self.pipe.is_empty() {
            a.push(Actor::TensorPipe);
        }
        if !self.tma.is_empty() {
            a.push(Actor::Tma);
        }
        a
    }

    fn arrive(&mut self, bar: usize, count: u32, tx: i64) -> Result<(), Violation> {
        let b = &mut self.bars[bar];
        b.tx += tx;
        b.pending -= i64::from(count);
        if b.pending < 0 {
            return Err(Violation(format!(
                "{}: {} arrivals past its count of {} in phase {}",
                self.proto.barriers[bar].name,
                -b.pending,
                self.proto.barriers[bar].arrivals,
                b.completed
            )));
        }
        self.settle(bar)
    }

    fn complete_tx(&mut self, bar: usize, bytes: u64) -> Result<(), Violation> {
        let b = &mut self.bars[bar];
        b.tx -= bytes as i64;
        // Every load is issued after the arrive that expects its bytes, so a negative count
        // is a load the phase did not expect.
        if b.tx < 0 {
            return Err(Violation(format!(
                "{}: phase {} got {} bytes more than expected",
                self.proto.barriers[bar].name, b.completed, -b.tx
            )));
        }
        self.settle(bar)
    }

    fn settle(&mut self, bar: usize) -> Result<(), Violation> {
        let arrivals = i64::from(self.proto.barriers[bar].arrivals);
        let b = &mut self.bars[bar];
        if b.pending == 0 && b.tx == 0 {
            b.completed += 1;
            b.pending = arrivals;
            self.stats.phases += 1;
        }
        Ok(())
    }

    fn read(&self, who: &str, buf: Buf, val: Val) -> Result<(), Violation> {
        match self.bufs.get(&buf) {
            Some(v) if *v == val => Ok(()),
            found => Err(Violation(format!(
                "{who} read {buf:?} expecting {val:?} but found {found:?} (overwritten before \
                 release, or read before written)"
            ))),
        }
    }

    fn step_role(&mut self, r: usize) -> Result<(), Violation> {
        let role = self.programs[r].0;
        let op = self.programs[r].1[self.pc[r]].clone();
        self.pc[r] += 1;
        let who = format!("{role:?}");
        match op {
            Op::Wait { bar, phase } => {
                // Passing on parity is only right when the barrier completed exactly the phase
                // meant: one phase fewer aliases (the consumer would run on stale data), and
                // two more means a producer lapped this consumer.
                let done = self.bars[bar].completed;
                if done != phase + 1 {
                    return Err(Violation(format!(
                        "{who} waited for phase {phase} of {} and passed on parity with {done} \
                         phases complete",
                        self.name(bar)
                    )));
                }
            }
            Op::Arrive { bar, count } => self.arrive(bar, count, 0)?,
            Op::ArriveExpectTx { bar, bytes } => self.arrive(bar, 1, bytes as i64)?,
            Op::Tma {
                bar,
                buf,
                val,
                bytes,
            } => self.tma.push(Queued::Tma {
                bar,
                buf,
                val,
                bytes,
            }),
            Op::Mma { reads, write } => self.pipe.push_back(Queued::Mma { reads, write }),
            Op::Commit { bar } => self.pipe.push_back(Queued::Commit(bar)),
            Op::Read { buf, val } => self.read(&who, buf, val)?,
            Op::Write { buf, val } => {
                self.bufs.insert(buf, val);
            }
        }
        Ok(())
    }

    fn run(mut self) -> Result<Stats, Violation> {
        loop {
            let actors = self.actors();
            if actors.is_empty() {
                break;
            }
            let preferred: Vec<Actor> = actors
                .iter()
                .copied()
                .filter(|a| Some(*a) != self.starved)
                .collect();
            let pool = if preferred.is_empty() {
                &actors
            } else {
                &preferred
            };
            let actor = pool[self.rng.random_range(0..pool.len())];
            self.stats.steps += 1;
            match actor {
                Actor::Role(role) => {
                    let r = self
                        .programs
                        .iter()
                        .position(|(x, _)| *x == role)
                        .expect("the actor came from the programs");
                    self.step_role(r)?;
                }
                Actor::TensorPipe => match self.pipe.pop_front() {
                    Some(Queued::Mma { reads, write }) => {
                        for (buf, val) in reads {
                            self.read("tensor pipe", buf, val)?;
                        }
                        // The correction column sits inside S's columns in every plan
                        // (C = P + BN/2 < BN): a new S clobbers it.
                        if let Buf::S(t) = write.0 {
                            self.bufs.remove(&Buf::C(t));
                        }
                        self.bufs.insert(write.0, write.1);
                    }
                    Some(Queued::Commit(bar)) => self.arrive(bar, 1, 0)?,
                    _ => unreachable!("the pipe holds MMAs and commits"),
                },
                Actor::Tma => {
                    let i = self.rng.random_range(0..self.tma.len());
                    if let Queued::Tma {
                        bar,
                        buf,
                        val,
                        bytes,
                    } = self.tma.swap_remove(i)
                    {
                        self.bufs.insert(buf, val);
                        self.complete_tx(bar, bytes)?;
                    }
                }
            }
        }
        let stuck: Vec<String> = self
            .programs
            .iter()
            .zip(&self.pc)
            .filter_map(|((role, ops), &pc)| {
                ops.get(pc).map(|op| match op {
                    Op::Wait { bar, phase } => format!(
                        "{role:?} waits for phase {phase} of {} ({} complete)",
                        self.name(*bar),
                        self.bars[*bar].completed
                    ),
                    other => format!("{role:?} at {other:?}"),
                })
            })
            .collect();
        if !stuck.is_empty() {
            return Err(Violation(format!("deadlock: {}", stuck.join("; "))));
        }
        for (i, b) in self.bars.iter().enumerate() {
            let spec = &self.proto.barriers[i];
            if b.pending != i64::from(spec.arrivals) || b.tx != 0 {
                return Err(Violation(format!(
                    "{} ends mid-phase: {} of {} arrivals outstanding, {} bytes",
                    spec.name, b.pending, spec.arrivals, b.tx
                )));
            }
        }
        for t in 0..2 {
            self.read("the end", Buf::Q(t), Val::Out(t))?;
        }
        Ok(self.stats)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::sm100::{FA4Inputs, Swizzle};

    fn config(depth: u32, dtype_size: u32) -> FA4Config {
        FA4Config::new(FA4Inputs {
            num_q_heads: 32,
            group: 4,
            depth,
            dtype_size,
            swizzle_mode: Swizzle::B128,
        })
        .unwrap()
    }

    /// Key blocks a CTA of `bm` rows at `row0` walks with `bn`-key blocks (bottom-right causal),
    /// written from the mask's definition for the model's sweep.
    fn blocks(sq: usize, sk: usize, row0: usize, bm: usize, bn: usize, causal: bool) -> usize {
        let end = if causal {
            (row0 + bm).min(sq) + sk - sq
        } else {
            sk
        };
        end.div_ceil(bn)
    }

    fn policies(seed: u64) -> Vec<Policy> {
        let mut p = vec![Policy::Random(seed)];
        for a in [
            Actor::TensorPipe,
            Actor::Tma,
            Actor::Role(Role::Correction),
            Actor::Role(Role::Softmax0),
            Actor::Role(Role::Softmax1),
            Actor::Role(Role::Mma),
            Actor::Role(Role::Load),
        ] {
            p.push(Policy::Starve(a, seed));
        }
        p
    }

    fn run_all(proto: &Protocol, max_blocks: usize, seeds: u64) -> Result<(), Violation> {
        for n in 0..=max_blocks {
            for seed in 0..seeds {
                for policy in policies(seed) {
                    proto
                        .simulate(n, policy)
                        .map_err(|v| Violation(format!("n = {n}, {policy:?}: {v}")))?;
                }
            }
        }
        Ok(())
    }

    const SUPPORTED_16BIT: [u32; 5] = [64, 80, 96, 112, 128];

    #[test]
    fn every_supported_plan_runs_its_protocol_for_every_block_count() {
        for d in SUPPORTED_16BIT {
            let cfg = config(d, 2);
            assert!(cfg.supported(), "d{d}");
            let proto = Protocol::new(&cfg);
            run_all(&proto, proto.kv_stages + 3, 6).unwrap_or_else(|v| panic!("d{d}: {v}"));
        }
    }

    #[test]
    fn causal_and_full_ctas_of_ragged_lengths_run() {
        let cfg = config(128, 2);
        let proto = Protocol::new(&cfg);
        let (bm, bn) = (cfg.bm() as usize, cfg.bn() as usize);
        for (sq, sk) in [(1, 1), (300, 300), (256, 1000), (700, 1531), (513, 513)] {
            for causal in [false, true] {
                for row0 in (0..sq).step_by(bm) {
                    let n = blocks(sq, sk, row0, bm, bn, causal);
                    for seed in 0..4 {
                        for policy in policies(seed) {
                            proto.simulate(n, policy).unwrap_or_else(|v| {
                                panic!("sq {sq} sk {sk} causal {causal} row0 {row0}: {v}")
                            });
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_barriers_fill_the_plans_barrier_budget() {
        for d in SUPPORTED_16BIT {
            let cfg = config(d, 2);
            let b = cfg.smem_budget();
            let proto = Protocol::new(&cfg);
            assert_eq!(
                proto.barrier_bytes(),
                b.misc_barriers + b.o_barriers + b.kv_barriers,
                "d{d}"
            );
            assert_eq!(proto.kv_tile_bytes * proto.kv_stages as u64, b.kv_tiles);
            assert_eq!(proto.q_tile_bytes * 2, b.q_tiles);
        }
    }

    #[test]
    fn the_correction_column_lies_inside_s_in_every_plan() {
        // The model clobbers C when a new S lands; that is only right if the plan puts C there.
        for d in SUPPORTED_16BIT {
            let regions = config(d, 2).tmem_regions();
            for t in 0..2 {
                let find = |name: String| {
                    regions
                        .iter()
                        .find(|r| r.name == name)
                        .unwrap_or_else(|| panic!("{name}"))
                };
                let (s, c) = (find(format!("S{t}")), find(format!("C{t}")));
                assert_eq!(s.start.lane(), c.start.lane(), "d{d}");
                assert!(
                    s.column_range().contains(&c.column_range().start),
                    "d{d} tile {t}: C {:?} outside S {:?}",
                    c.column_range(),
                    s.column_range()
                );
            }
        }
    }

    #[test]
    fn the_prelude_names_every_barrier_once() {
        let proto = Protocol::new(&config(128, 2));
        let prelude = proto.prelude();
        for b in &proto.barriers {
            let name = format!("BAR_{} =", b.name.to_uppercase());
            assert_eq!(prelude.matches(&name).count(), 1, "{name}");
        }
        assert!(prelude.contains(&format!("BAR_COUNT = {}", proto.barriers.len())));
    }

    fn must_fail(m: Mutation, needle: &str) {
        let proto = Protocol::new(&config(128, 2)).mutated(m);
        let err = run_all(&proto, proto.kv_stages + 3, 8).expect_err("the mutation must fail");
        assert!(err.0.contains(needle), "{m:?}: {err}");
    }

    #[test]
    fn one_arrival_short_deadlocks() {
        must_fail(Mutation::OneArrivalShort, "deadlock");
    }

    #[test]
    fn a_missing_release_deadlocks_the_loader() {
        must_fail(Mutation::MissingKRelease, "Load waits");
    }

    #[test]
    fn releasing_at_issue_lets_the_loader_overwrite_a_slot_in_use() {
        must_fail(Mutation::ReleaseAtIssue, "overwritten");
    }

    #[test]
    fn releasing_s_before_p_is_written_is_caught() {
        must_fail(Mutation::EarlyPRelease, "expecting P(");
    }

    #[test]
    fn the_correction_acquire_is_implied_by_the_o_pipeline() {
        // The MMA issues S_t(j+1) only after the correction released O_t for block j, which it
        // does after reading C_t(j): so C cannot be overwritten early even without the acquire.
        // If a schedule change breaks this, the acquire has become load-bearing.
        let proto = Protocol::new(&config(128, 2)).mutated(Mutation::NoCorrectionAcquire);
        run_all(&proto, proto.kv_stages + 3, 4).unwrap();
    }

    #[test]
    fn unexpected_bytes_are_caught() {
        must_fail(Mutation::Q0BytesNotExpected, "bytes more than expected");
    }
}
