//! The moonep planner: a pure, deterministic, integer-only function (docs/specs/moonep.md §2).
//!
//! Every rank runs it redundantly on the gathered `tpe[R][E]`, so the result is bit-identical
//! everywhere and no plan broadcast is needed. The CUDA port (`crate::gpu`) must reproduce it
//! bit for bit; all tie rules are "lowest index wins" and all arithmetic is integer.
//!
//! # API
//! - [`PlanConfig`]: `ranks` (R), `experts` (E, `E % R == 0`), `top_k` (K), `capacity_s` (S, max
//!   tokens per rank per call, sizes every buffer), `padding` (P), and the token [`TokenMode`]:
//!   `Uniform { s }` (same `s` on every rank, `T = R*s`) or `PerRank { total_tokens }` (`T`,
//!   host-known; each rank's `s_r = Σ_e tpe[r][e] / K`).
//! - [`plan_global`]`(cfg, tpe)` with `tpe` row-major `[R*E]` (`tpe[r*E + e]`) runs stages A–C
//!   and returns a [`GlobalPlan`]: `alloc[e*R + d]`, the stage-A [`Transfer`] rounds (the sparse
//!   `z[h][u]`), and for every rank `d` a [`RankLayout`] (`experts_to_copy`, `counts`,
//!   `cu_seqlens`, `zero_fill`).
//! - [`plan_entries`]`(cfg, plan, rank, topk)` with `topk` = this rank's flat `[s*K]` expert ids
//!   (entry `i = t*K + k`) runs stage D and returns `dst[i] = d*NvS + loff` as `i64`
//!   ([`pack_slot`] / [`unpack_slot`]).
//!
//! # Stages (all ties go to the lowest index)
//! - **A** (rank quotas): `bal[h] = G_h − cap_h` (i64). Loop: `h = argmax bal`, `u = argmin bal`;
//!   stop when `bal[h] <= 0`; `m = −bal[u]`; record `Transfer { donor: h, receiver: u, tokens: m }`;
//!   `bal[h] −= m`; `bal[u] = 0`.
//! - **B** (per donor `h`, in ascending `h`; donors are independent): `q[d]` = tokens `h` sends to
//!   `d`, `rem[le] = T_{h*epn+le}`. Loop: `d = argmax q`; stop when `q[d] <= 0`;
//!   `le = argmax rem`; `take = min(rem[le], q[d])`; move `take` from `alloc[e][h]` to
//!   `alloc[e][d]`; `rem[le] −= take`; `q[d] −= take`.
//! - **C** (layout of `d`): groups `g < epn` are home experts `d*epn+g` with `counts[g] =
//!   alloc[e][d]`; remote experts with `alloc[e][d] > 0` in ascending global id fill groups
//!   `epn + b` and `experts_to_copy[b] = e` (−1 when unused). Each count is padded up to a
//!   multiple of P (0 stays 0); `cu_seqlens[g]` is the exclusive padded end of group `g`;
//!   `zero_fill[g] = (start + count, padded − count)`.
//! - **D** (entries of source rank `r`): `j` = number of earlier entries of the same expert on
//!   `r`; `g = src_offset[r][e] + j` with `src_offset[r][e] = Σ_{r'<r} tpe[r'][e]`; `d` = first
//!   rank with `alloc_cum[e][d] > g` (inclusive prefix over `d`); `loff = off(d, e) + g −
//!   alloc_cum[e][d−1]`, where `off(d, e)` is the start row of `e`'s group on `d`.
//!
//! Shapes: `NvS = align_up(S*K + (P−1)*2*epn, P)`, `nvs_s = align_up(ceil(T*K/R) + (P−1)*2*epn,
//! P)`, `cap_d = floor(T*K/R) + (d < (T*K mod R))` (= `s*K` in uniform mode).

mod entries;
mod global;
mod verify;

pub use entries::{pack_slot, plan_entries, unpack_slot};
pub use global::plan_global;
pub use verify::{InvariantViolation, verify_entries, verify_global};

/// How many tokens each rank holds this call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenMode {
    /// Every rank holds exactly `s` tokens (`1 <= s <= S`); `T = R*s`.
    Uniform { s: u32 },
    /// Ranks hold different counts; `total_tokens = T = Σ_r s_r` is known on the host.
    PerRank { total_tokens: u64 },
}

/// Static and per-call sizes of one planning call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PlanConfig {
    /// EP ranks `R` (>= 1).
    pub ranks: u32,
    /// Routed experts `E`; `E % R == 0`.
    pub experts: u32,
    /// Top-k `K` (>= 1); repeated experts inside one token are legal.
    pub top_k: u32,
    /// Capacity `S`: max tokens per rank per call; sizes every buffer.
    pub capacity_s: u32,
    /// Token padding `P` (>= 1): every non-empty group is padded to a multiple of `P`.
    pub padding: u32,
    /// Tokens this call.
    pub mode: TokenMode,
}

impl PlanConfig {
    /// Experts per rank, `epn = E / R`.
    pub fn experts_per_rank(&self) -> usize {
        (self.experts / self.ranks.max(1)) as usize
    }

    /// Home rank of expert `e` (contiguous blocks).
    pub fn home(&self, expert: usize) -> usize {
        expert / self.experts_per_rank()
    }

    /// Slots per rank shard, `NvS = align_up(S*K + (P−1)*2*epn, P)`.
    pub fn shard_slots(&self) -> u64 {
        let headroom = u64::from(self.padding - 1) * 2 * self.experts_per_rank() as u64;
        align_up(
            u64::from(self.capacity_s) * u64::from(self.top_k) + headroom,
            self.padding,
        )
    }

    /// Total tokens `T` of this call.
    pub fn total_tokens(&self) -> u64 {
        match self.mode {
            TokenMode::Uniform { s } => u64::from(s) * u64::from(self.ranks),
            TokenMode::PerRank { total_tokens } => total_tokens,
        }
    }

    /// Rows valid this step, `nvs_s = align_up(ceil(T*K/R) + (P−1)*2*epn, P)`; same on all ranks.
    pub fn step_slots(&self) -> u64 {
        let tk = self.total_tokens() * u64::from(self.top_k);
        let headroom = u64::from(self.padding - 1) * 2 * self.experts_per_rank() as u64;
        align_up(tk.div_ceil(u64::from(self.ranks)) + headroom, self.padding)
    }

    /// Receive quota of rank `d`: `floor(T*K/R) + (d < T*K mod R)`.
    pub fn quota(&self, rank: usize) -> u64 {
        let tk = self.total_tokens() * u64::from(self.top_k);
        let r = u64::from(self.ranks);
        tk / r + u64::from((rank as u64) < tk % r)
    }

    /// Checks the static sizes: `R >= 1`, `E % R == 0`, `K >= 1`, `P >= 1`, `S >= 1`, and `s`/`T`
    /// within capacity.
    pub fn validate(&self) -> Result<(), PlanError> {
        let bad = |reason: String| Err(PlanError::InvalidConfig { reason });
        if self.ranks == 0 || self.experts == 0 || self.top_k == 0 || self.padding == 0 {
            return bad(format!("R, E, K and P must be >= 1, got {self:?}"));
        }
        if self.capacity_s == 0 {
            return bad("capacity S must be >= 1".into());
        }
        if !self.experts.is_multiple_of(self.ranks) {
            return bad(format!(
                "E={} is not a multiple of R={}",
                self.experts, self.ranks
            ));
        }
        match self.mode {
            TokenMode::Uniform { s } if s == 0 || s > self.capacity_s => {
                bad(format!("s={s} outside 1..={}", self.capacity_s))
            }
            TokenMode::PerRank { total_tokens }
                if total_tokens < u64::from(self.ranks)
                    || total_tokens > u64::from(self.ranks) * u64::from(self.capacity_s) =>
            {
                bad(format!(
                    "T={total_tokens} outside R..=R*S ({}..={})",
                    self.ranks,
                    u64::from(self.ranks) * u64::from(self.capacity_s)
                ))
            }
            _ => Ok(()),
        }
    }
}

/// One stage-A round: `donor` sends `tokens` of its home group's load to `receiver` (`z[h][u]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Transfer {
    pub donor: u32,
    pub receiver: u32,
    pub tokens: u64,
}

/// Compute layout of one rank: `2*epn` groups (home experts, then prefetch slots).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RankLayout {
    /// `[epn]`: global id of the remote expert held in prefetch slot `b`, or −1.
    pub experts_to_copy: Vec<i32>,
    /// `[2*epn]`: real rows of each group.
    pub counts: Vec<u32>,
    /// `[2*epn]`: exclusive padded end offset of each group (`cu[-1] := 0`).
    pub cu_seqlens: Vec<u32>,
    /// `[2*epn]`: `(first padding row, padding rows)` of each group.
    pub zero_fill: Vec<(u32, u32)>,
}

impl RankLayout {
    /// Start row of group `g`.
    pub fn group_start(&self, group: usize) -> u32 {
        if group == 0 {
            0
        } else {
            self.cu_seqlens[group - 1]
        }
    }

    /// Rows used by all groups (`cu_seqlens[2*epn − 1]`).
    pub fn used_rows(&self) -> u32 {
        self.cu_seqlens.last().copied().unwrap_or(0)
    }
}

/// Result of stages A–C; identical on every rank.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GlobalPlan {
    /// `R`, `E`, `epn` copied from the config.
    pub ranks: usize,
    pub experts: usize,
    pub experts_per_rank: usize,
    /// `NvS` and `nvs_s`.
    pub shard_slots: u64,
    pub step_slots: u64,
    /// Tokens held by each source rank, `s_r`.
    pub tokens_per_rank: Vec<u32>,
    /// Receive quota of each rank, `cap_d`.
    pub quota: Vec<u64>,
    /// Global tokens per expert, `T_e`.
    pub expert_tokens: Vec<u64>,
    /// `[E*R]` row-major: `alloc[e*R + d]`.
    pub alloc: Vec<u32>,
    /// `[E*R]` inclusive prefix of `alloc` over `d`.
    pub alloc_cum: Vec<u32>,
    /// `[R*E]` exclusive prefix of `tpe` over source ranks: `Σ_{r'<r} tpe[r'][e]`.
    pub src_offset: Vec<u32>,
    /// Stage-A rounds in the order they were made (<= R−1).
    pub rounds: Vec<Transfer>,
    /// `[R]` per-rank layouts.
    pub layouts: Vec<RankLayout>,
}

impl GlobalPlan {
    /// `alloc[e][d]`.
    pub fn alloc_at(&self, expert: usize, rank: usize) -> u32 {
        self.alloc[expert * self.ranks + rank]
    }

    /// Group index serving `expert` on `rank`, if `rank` computes it (home group, or prefetch slot).
    pub fn group_of(&self, rank: usize, expert: usize) -> Option<usize> {
        let epn = self.experts_per_rank;
        if expert / epn == rank {
            return Some(expert % epn);
        }
        let slots = &self.layouts[rank].experts_to_copy;
        slots
            .iter()
            .position(|&x| x == expert as i32)
            .map(|b| epn + b)
    }

    /// Expert served by group `g` of `rank` (`None` for an unused prefetch slot).
    pub fn expert_of_group(&self, rank: usize, group: usize) -> Option<usize> {
        let epn = self.experts_per_rank;
        if group < epn {
            Some(rank * epn + group)
        } else {
            let e = self.layouts[rank].experts_to_copy[group - epn];
            (e >= 0).then_some(e as usize)
        }
    }

    /// Replicas (remote experts with `alloc > 0`) computed on `rank`.
    pub fn replicas_on(&self, rank: usize) -> usize {
        self.layouts[rank]
            .experts_to_copy
            .iter()
            .filter(|&&e| e >= 0)
            .count()
    }

    /// Tokens computed away from their expert's home rank.
    pub fn migrated_tokens(&self) -> u64 {
        let epn = self.experts_per_rank;
        (0..self.experts)
            .map(|e| {
                (0..self.ranks)
                    .filter(|&d| d != e / epn)
                    .map(|d| u64::from(self.alloc_at(e, d)))
                    .sum::<u64>()
            })
            .sum()
    }
}

/// Contract violations and bad configurations; planning never hangs or panics on bad input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("invalid planner config: {reason}")]
    InvalidConfig { reason: String },
    #[error("tpe has {got} entries, expected R*E = {expected}")]
    TpeLength { got: usize, expected: usize },
    #[error("rank {rank}: Σ_e tpe = {sum}, expected s*K = {expected}")]
    RankTokens {
        rank: usize,
        sum: u64,
        expected: u64,
    },
    #[error("rank {rank}: Σ_e tpe = {sum} is not a multiple of K = {top_k}")]
    NotMultipleOfK { rank: usize, sum: u64, top_k: u32 },
    #[error("rank {rank}: {tokens} tokens outside 1..={capacity}")]
    RankTokensOutOfRange {
        rank: usize,
        tokens: u64,
        capacity: u32,
    },
    #[error("Σ_r s_r = {sum} but T = {total}")]
    TotalMismatch { sum: u64, total: u64 },
    #[error("rank {rank} out of range (R = {ranks})")]
    RankOutOfRange { rank: usize, ranks: usize },
    #[error("rank {rank}: topk has {got} entries, expected s*K = {expected}")]
    TopkLength {
        rank: usize,
        got: usize,
        expected: usize,
    },
    #[error("rank {rank}: entry {entry} routes to expert {expert} >= E = {experts}")]
    ExpertOutOfRange {
        rank: usize,
        entry: usize,
        expert: u32,
        experts: usize,
    },
    #[error("rank {rank}: topk has {counted} entries of expert {expert} but tpe says {expected}")]
    TopkHistogram {
        rank: usize,
        expert: usize,
        counted: u64,
        expected: u64,
    },
    #[error("plan does not match config (R={ranks}, E={experts})")]
    PlanMismatch { ranks: usize, experts: usize },
    #[error("internal planner invariant broken: {what}")]
    Internal { what: String },
}

/// `x` rounded up to a multiple of `p` (`p >= 1`).
pub fn align_up(x: u64, p: u32) -> u64 {
    x.div_ceil(u64::from(p)) * u64::from(p)
}
