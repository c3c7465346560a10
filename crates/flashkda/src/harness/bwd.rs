//! Device buffers of a backward call for a [`DeviceProblem`]: the upstream gradients and the
//! gradient outputs, NaN-poisoned with canaries past their ends, and read-back as f64.

use cudarc::driver::CudaSlice;

use super::{CANARY_BF16, CANARY_F32, CANARY_LEN, DeviceProblem, NAN_BF16, bits};
use crate::error::{DriverContext, FlashKdaError};
use crate::reference::KdaGrads;
use crate::validate::{BwdArgs, DType};

/// A gradient output: bf16 or fp32 elements followed by a canary.
enum Out {
    Bf16(CudaSlice<u16>),
    F32(CudaSlice<f32>),
}

/// The upstream gradients (`dout`, optional `dfinal_state`) and every gradient output of one call.
pub struct DeviceGrads {
    dout: CudaSlice<u16>,
    dht: Option<Out>,
    dq: Out,
    dk: Out,
    dv: Out,
    dg: Out,
    dbeta: Out,
    da_log: Out,
    ddt_bias: Out,
    dh0: Option<Out>,
}

impl DeviceProblem {
    /// Uploads `dout` (`[T, H, 128]`, rounded to bf16) and `dfinal` (`[N, H, 128, 128]`, in the
    /// call's state dtype `fp32`), and allocates poisoned gradient outputs (`dinitial` in the
    /// state dtype).
    pub fn grads(
        &self,
        dout: &[f32],
        dfinal: Option<&[f32]>,
        dinitial: bool,
        fp32: bool,
    ) -> Result<DeviceGrads, FlashKdaError> {
        let s = &self.stream;
        let t = self.batch * self.seq_len;
        let st = self.num_seqs * self.heads * self.head_dim * self.head_dim;
        let bf = |n: usize| -> Result<Out, FlashKdaError> {
            let mut v = vec![NAN_BF16; n];
            v.extend([CANARY_BF16; CANARY_LEN]);
            Ok(Out::Bf16(s.clone_htod(&v).during("upload")?))
        };
        let f32_ = |n: usize| -> Result<Out, FlashKdaError> {
            let mut v = vec![f32::NAN; n];
            v.extend([f32::from_bits(CANARY_F32); CANARY_LEN]);
            Ok(Out::F32(s.clone_htod(&v).during("upload")?))
        };
        let state = |n: usize| if fp32 { f32_(n) } else { bf(n) };
        let dht = match dfinal {
            None => None,
            Some(x) if fp32 => Some(Out::F32(s.clone_htod(x).during("upload")?)),
            Some(x) => Some(Out::Bf16(s.clone_htod(&bits(x)).during("upload")?)),
        };
        Ok(DeviceGrads {
            dout: s.clone_htod(&bits(dout)).during("upload")?,
            dht,
            dq: bf(t * self.qk_heads * self.head_dim)?,
            dk: bf(t * self.qk_heads * self.head_dim)?,
            dv: bf(t * self.heads * self.head_dim)?,
            dg: bf(t * self.heads * self.head_dim)?,
            dbeta: bf(t * self.heads)?,
            da_log: f32_(self.heads)?,
            ddt_bias: f32_(self.heads * self.head_dim)?,
            dh0: if dinitial { Some(state(st)?) } else { None },
        })
    }

    fn out_view(&self, o: &Out, shape: &[usize]) -> crate::validate::TensorView {
        match o {
            Out::Bf16(b) => self.view(b, DType::BF16, shape),
            Out::F32(f) => self.view(f, DType::F32, shape),
        }
    }

    /// The backward call's arguments (the forward inputs of [`Self::args`] and `g`'s buffers).
    pub fn bwd_args(&self, g: &DeviceGrads) -> BwdArgs {
        let f = self.args();
        let act = [self.batch, self.seq_len, self.heads, self.head_dim];
        let qk = [self.batch, self.seq_len, self.qk_heads, self.head_dim];
        let st = [self.num_seqs, self.heads, self.head_dim, self.head_dim];
        BwdArgs {
            q: f.q,
            k: f.k,
            v: f.v,
            g: f.g,
            beta: f.beta,
            a_log: f.a_log,
            dt_bias: f.dt_bias,
            initial_state: f.initial_state,
            cu_seqlens: f.cu_seqlens,
            scale: f.scale,
            lower_bound: f.lower_bound,
            dout: self.view(&g.dout, DType::BF16, &act),
            dfinal_state: g.dht.as_ref().map(|o| self.out_view(o, &st)),
            dq: self.out_view(&g.dq, &qk),
            dk: self.out_view(&g.dk, &qk),
            dv: self.out_view(&g.dv, &act),
            dg: self.out_view(&g.dg, &act),
            dbeta: self.out_view(&g.dbeta, &act[..3]),
            da_log: self.out_view(&g.da_log, &[self.heads]),
            ddt_bias: self.out_view(&g.ddt_bias, &[self.heads, self.head_dim]),
            dinitial_state: g.dh0.as_ref().map(|o| self.out_view(o, &st)),
        }
    }

    /// Reads every gradient output back; errors when a canary changed.
    pub fn read_grads(&self, g: &DeviceGrads) -> Result<KdaGrads, String> {
        let s = &self.stream;
        let read = |name: &str, o: &Out| -> Result<Vec<f64>, String> {
            let (vals, ok): (Vec<f64>, bool) = match o {
                Out::Bf16(b) => {
                    let x = s.clone_dtoh(b).map_err(|e| e.to_string())?;
                    let n = x.len() - CANARY_LEN;
                    (
                        x[..n]
                            .iter()
                            .map(|&b| f64::from(half::bf16::from_bits(b).to_f32()))
                            .collect(),
                        x[n..].iter().all(|&b| b == CANARY_BF16),
                    )
                }
                Out::F32(f) => {
                    let x = s.clone_dtoh(f).map_err(|e| e.to_string())?;
                    let n = x.len() - CANARY_LEN;
                    (
                        x[..n].iter().map(|&v| f64::from(v)).collect(),
                        x[n..].iter().all(|&v| v.to_bits() == CANARY_F32),
                    )
                }
            };
            if ok {
                Ok(vals)
            } else {
                Err(format!("canary after `{name}` overwritten"))
            }
        };
        Ok(KdaGrads {
            dq: read("dq", &g.dq)?,
            dk: read("dk", &g.dk)?,
            dv: read("dv", &g.dv)?,
            dg: read("dg", &g.dg)?,
            dbeta: read("dbeta", &g.dbeta)?,
            dbeta_scale: Vec::new(),
            da_log_scale: Vec::new(),
            ddt_bias_scale: Vec::new(),
            da_log: read("dA_log", &g.da_log)?,
            ddt_bias: read("ddt_bias", &g.ddt_bias)?,
            dinitial_state: match &g.dh0 {
                Some(o) => read("dinitial_state", o)?,
                None => Vec::new(),
            },
        })
    }
}
