//! A [`KdaProblem`] uploaded to one GPU, for the GPU tests and the bench: device buffers,
//! NaN poisoning, canaries past the end of every output, and read-back.

use std::sync::Arc;

mod bwd;
pub use bwd::DeviceGrads;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use crate::error::{DriverContext, FlashKdaError};
use crate::reference::KdaProblem;
use crate::validate::{DType, FwdArgs, TensorView};

/// Which state tensors a call passes, and their dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateIo {
    pub initial: bool,
    pub final_: bool,
    pub fp32: bool,
}

impl StateIo {
    pub const NONE: StateIo = StateIo {
        initial: false,
        final_: false,
        fp32: false,
    };
    pub fn both(fp32: bool) -> Self {
        StateIo {
            initial: true,
            final_: true,
            fp32,
        }
    }
    /// Relative error of a read-back final state against an emulation's fp32 state, rounded to this
    /// dtype first (the kernel rounds once on the way out); 0 when the call writes no final state.
    pub fn final_state_error(&self, got: &[f64], emulated: &[f64]) -> f64 {
        if !self.final_ {
            return 0.0;
        }
        let rounded: Vec<f64> = if self.fp32 {
            emulated.to_vec()
        } else {
            emulated
                .iter()
                .map(|&x| f64::from(half::bf16::from_f64(x).to_f32()))
                .collect()
        };
        crate::reference::metrics::rel_frobenius(got, &rounded)
    }
    pub fn label(&self) -> String {
        let d = if self.fp32 { "fp32" } else { "bf16" };
        match (self.initial, self.final_) {
            (false, false) => "none".into(),
            (true, false) => format!("in-{d}"),
            (false, true) => format!("out-{d}"),
            (true, true) => format!("inout-{d}"),
        }
    }
}

/// Elements written past the end of each output as a canary.
pub const CANARY_LEN: usize = 64;
const CANARY_BF16: u16 = 0x1234;
const CANARY_F32: u32 = 0x1234_5678;
const NAN_BF16: u16 = 0x7fc0;

/// Device copies of a problem's tensors.
pub struct DeviceProblem {
    pub stream: Arc<CudaStream>,
    ordinal: usize,
    batch: usize,
    seq_len: usize,
    heads: usize,
    qk_heads: usize,
    head_dim: usize,
    num_seqs: usize,
    q: CudaSlice<u16>,
    k: CudaSlice<u16>,
    v: CudaSlice<u16>,
    g: CudaSlice<u16>,
    beta: CudaSlice<u16>,
    a_log: CudaSlice<f32>,
    dt_bias: CudaSlice<f32>,
    out: CudaSlice<u16>,
    h0_bf16: Option<CudaSlice<u16>>,
    h0_f32: Option<CudaSlice<f32>>,
    ht_bf16: Option<CudaSlice<u16>>,
    ht_f32: Option<CudaSlice<f32>>,
    cu: Option<CudaSlice<i64>>,
    pub scale: f32,
    pub lower_bound: f32,
}

fn bits(x: &[f32]) -> Vec<u16> {
    x.iter()
        .map(|&v| half::bf16::from_f32(v).to_bits())
        .collect()
}

impl DeviceProblem {
    /// Uploads `p`. With `batched`, the sequences (all of equal length) become batch rows and
    /// no `cu_seqlens` is passed; otherwise batch is 1 and `cu_seqlens` is passed when there is
    /// more than one sequence.
    pub fn upload(
        stream: &Arc<CudaStream>,
        p: &KdaProblem,
        state: StateIo,
        batched: bool,
    ) -> Result<Self, FlashKdaError> {
        let t = p.tokens();
        let n = p.seq_lens.len();
        let s = stream;
        let (batch, seq_len, varlen) = if batched {
            assert!(
                p.seq_lens.iter().all(|&l| l == p.seq_lens[0]),
                "batched needs equal lengths"
            );
            (n, p.seq_lens[0], false)
        } else {
            (1, t, n > 1)
        };
        let up16 = |x: &[f32]| s.clone_htod(&bits(x)).during("upload");
        let d = p.head_dim;
        let act = t * p.heads * d;
        let mut out = s
            .clone_htod(&vec![NAN_BF16; act + CANARY_LEN])
            .during("upload")?;
        s.memcpy_htod(&[CANARY_BF16; CANARY_LEN], &mut out.slice_mut(act..))
            .during("upload")?;
        let st_len = n * p.heads * d * d;
        let h0_src: Vec<f32> = p.initial_state.clone().unwrap_or_else(|| vec![0.0; st_len]);
        let (mut h0_bf16, mut h0_f32, mut ht_bf16, mut ht_f32) = (None, None, None, None);
        if state.initial {
            if state.fp32 {
                h0_f32 = Some(s.clone_htod(&h0_src).during("upload")?);
            } else {
                h0_bf16 = Some(up16(&h0_src)?);
            }
        }
        if state.final_ {
            if state.fp32 {
                let mut v = vec![f32::NAN.to_bits(); st_len];
                v.extend([CANARY_F32; CANARY_LEN]);
                let v: Vec<f32> = v.into_iter().map(f32::from_bits).collect();
                ht_f32 = Some(s.clone_htod(&v).during("upload")?);
            } else {
                let mut v = vec![NAN_BF16; st_len];
                v.extend([CANARY_BF16; CANARY_LEN]);
                ht_bf16 = Some(s.clone_htod(&v).during("upload")?);
            }
        }
        Ok(DeviceProblem {
            stream: s.clone(),
            ordinal: s.context().ordinal(),
            batch,
            seq_len,
            heads: p.heads,
            qk_heads: p.qk_heads,
            head_dim: d,
            num_seqs: n,
            q: up16(&p.q)?,
            k: up16(&p.k)?,
            v: up16(&p.v)?,
            g: up16(&p.g)?,
            beta: up16(&p.beta)?,
            a_log: s.clone_htod(&p.a_log).during("upload")?,
            dt_bias: s.clone_htod(&p.dt_bias).during("upload")?,
            out,
            h0_bf16,
            h0_f32,
            ht_bf16,
            ht_f32,
            cu: if varlen {
                Some(s.clone_htod(&p.cu_seqlens()).during("upload")?)
            } else {
                None
            },
            scale: p.scale,
            lower_bound: p.lower_bound,
        })
    }

    fn view<T>(&self, buf: &CudaSlice<T>, dtype: DType, shape: &[usize]) -> TensorView {
        let (ptr, _sync) = buf.device_ptr(&self.stream);
        TensorView::contiguous(ptr, dtype, shape, self.ordinal)
    }

    /// The call's arguments.
    pub fn args(&self) -> FwdArgs {
        let d = self.head_dim;
        let act = [self.batch, self.seq_len, self.heads, d];
        let qk = [self.batch, self.seq_len, self.qk_heads, d];
        let st = [self.num_seqs, self.heads, d, d];
        let state = |b: &Option<CudaSlice<u16>>, f: &Option<CudaSlice<f32>>| {
            b.as_ref()
                .map(|x| self.view(x, DType::BF16, &st))
                .or_else(|| f.as_ref().map(|x| self.view(x, DType::F32, &st)))
        };
        FwdArgs {
            q: self.view(&self.q, DType::BF16, &qk),
            k: self.view(&self.k, DType::BF16, &qk),
            v: self.view(&self.v, DType::BF16, &act),
            g: self.view(&self.g, DType::BF16, &act),
            beta: self.view(&self.beta, DType::BF16, &act[..3]),
            out: self.view(&self.out, DType::BF16, &act),
            a_log: self.view(&self.a_log, DType::F32, &[self.heads]),
            dt_bias: self.view(&self.dt_bias, DType::F32, &[self.heads, d]),
            initial_state: state(&self.h0_bf16, &self.h0_f32),
            final_state: state(&self.ht_bf16, &self.ht_f32),
            cu_seqlens: self
                .cu
                .as_ref()
                .map(|c| self.view(c, DType::I64, &[self.num_seqs + 1])),
            scale: self.scale,
            lower_bound: self.lower_bound,
        }
    }

    /// Copies `src`'s inputs (q, k, v, g, beta, A_log, dt_bias, initial state, cu_seqlens) into
    /// this problem's buffers on this problem's stream, as a captured graph's caller would before
    /// a replay. Both must have the same shapes and state tensors.
    pub fn copy_inputs_from(&mut self, src: &DeviceProblem) -> Result<(), FlashKdaError> {
        fn copy<T>(
            s: &Arc<CudaStream>,
            from: &CudaSlice<T>,
            to: &mut CudaSlice<T>,
        ) -> Result<(), FlashKdaError> {
            assert_eq!(from.len(), to.len(), "copy_inputs_from: shapes differ");
            s.memcpy_dtod(from, to).during("copying inputs")
        }
        fn copy_opt<T>(
            s: &Arc<CudaStream>,
            from: &Option<CudaSlice<T>>,
            to: &mut Option<CudaSlice<T>>,
        ) -> Result<(), FlashKdaError> {
            match (from, to) {
                (Some(f), Some(t)) => copy(s, f, t),
                (None, None) => Ok(()),
                _ => panic!("copy_inputs_from: state or cu_seqlens tensors differ"),
            }
        }
        let s = self.stream.clone();
        // src's uploads were enqueued on its own stream
        src.stream.synchronize().during("waiting for the source")?;
        for (f, t) in [
            (&src.q, &mut self.q),
            (&src.k, &mut self.k),
            (&src.v, &mut self.v),
            (&src.g, &mut self.g),
            (&src.beta, &mut self.beta),
        ] {
            copy(&s, f, t)?;
        }
        copy(&s, &src.a_log, &mut self.a_log)?;
        copy(&s, &src.dt_bias, &mut self.dt_bias)?;
        copy_opt(&s, &src.h0_bf16, &mut self.h0_bf16)?;
        copy_opt(&s, &src.h0_f32, &mut self.h0_f32)?;
        copy_opt(&s, &src.cu, &mut self.cu)
    }

    /// Refills `out` and the final state with NaN (canaries untouched).
    pub fn poison(&mut self) -> Result<(), FlashKdaError> {
        let s = self.stream.clone();
        let act = self.out.len() - CANARY_LEN;
        s.memcpy_htod(&vec![NAN_BF16; act], &mut self.out.slice_mut(..act))
            .during("poison")?;
        if let Some(h) = self.ht_bf16.as_mut() {
            let n = h.len() - CANARY_LEN;
            s.memcpy_htod(&vec![NAN_BF16; n], &mut h.slice_mut(..n))
                .during("poison")?;
        }
        if let Some(h) = self.ht_f32.as_mut() {
            let n = h.len() - CANARY_LEN;
            s.memcpy_htod(&vec![f32::NAN; n], &mut h.slice_mut(..n))
                .during("poison")?;
        }
        Ok(())
    }

    /// `(out, final_state)` as f64 (state empty when not requested); errors when a canary changed.
    pub fn read(&self) -> Result<(Vec<f64>, Vec<f64>), String> {
        let s = &self.stream;
        let o = s.clone_dtoh(&self.out).map_err(|e| e.to_string())?;
        let act = o.len() - CANARY_LEN;
        if o[act..].iter().any(|&b| b != CANARY_BF16) {
            return Err("canary after `out` overwritten".into());
        }
        let out = o[..act]
            .iter()
            .map(|&b| f64::from(half::bf16::from_bits(b).to_f32()))
            .collect();
        let mut st = Vec::new();
        if let Some(h) = &self.ht_bf16 {
            let x = s.clone_dtoh(h).map_err(|e| e.to_string())?;
            let n = x.len() - CANARY_LEN;
            if x[n..].iter().any(|&b| b != CANARY_BF16) {
                return Err("canary after `final_state` overwritten".into());
            }
            st = x[..n]
                .iter()
                .map(|&b| f64::from(half::bf16::from_bits(b).to_f32()))
                .collect();
        }
        if let Some(h) = &self.ht_f32 {
            let x = s.clone_dtoh(h).map_err(|e| e.to_string())?;
            let n = x.len() - CANARY_LEN;
            if x[n..].iter().any(|&b| b.to_bits() != CANARY_F32) {
                return Err("canary after `final_state` overwritten".into());
            }
            st = x[..n].iter().map(|&b| f64::from(b)).collect();
        }
        Ok((out, st))
    }
}
