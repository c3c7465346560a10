//! The crate's one error type.

/// Why a forward call was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum FlashKdaError {
    #[error("{tensor}: expected dtype {expected}, got {found}")]
    DType {
        tensor: &'static str,
        expected: &'static str,
        found: String,
    },
    #[error("{tensor}: expected shape {expected}, got {found:?}")]
    Shape {
        tensor: &'static str,
        expected: String,
        found: Vec<usize>,
    },
    #[error(
        "{tensor}: must be contiguous row-major; shape {shape:?} has strides {strides:?} (elements)"
    )]
    NotContiguous {
        tensor: &'static str,
        shape: Vec<usize>,
        strides: Vec<isize>,
    },
    #[error("{tensor}: data pointer {ptr:#x} is not {align}-byte aligned")]
    Misaligned {
        tensor: &'static str,
        ptr: u64,
        align: u64,
    },
    #[error("{tensor}: is on {found}, expected cuda:{expected}")]
    Device {
        tensor: &'static str,
        expected: usize,
        found: String,
    },
    #[error("{tensor}: null data pointer for a non-empty tensor")]
    NullPointer { tensor: &'static str },
    #[error("lower_bound {0} is outside [-5, 0)")]
    LowerBound(f32),
    #[error("scale {0} is not finite")]
    Scale(f32),
    #[error("cu_seqlens given with batch {0}: pack the sequences into batch 1")]
    VarlenBatch(usize),
    #[error("initial_state is {initial}, final_state is {final_}: state dtypes must match")]
    StateDTypeMismatch {
        initial: &'static str,
        final_: &'static str,
    },
    #[error("cu_seqlens {0}")]
    CuSeqlens(String),
    #[error("problem too large: {0}")]
    TooLarge(String),
    #[error(
        "{heads} value heads over {qk_heads} query/key heads (GVA) run only on the workspace schedule, \
         not {schedule}"
    )]
    GvaSchedule {
        heads: usize,
        qk_heads: usize,
        schedule: String,
    },
    #[error("split operands run only on the workspace schedule, not {schedule}")]
    OperandsSchedule { schedule: String },
    #[error(
        "head dim {head_dim} runs only on the workspace schedule with value split One, Two or Four \
         (no other kernel is built for it), not {what}"
    )]
    HeadDimSchedule { head_dim: usize, what: String },
    #[error(
        "the chunk-64 forward (opt-in KernelSchedule::Chunk64: head dim 128, one 2-warpgroup block per \
         chain, split operands, no context parallelism) does not take {0}"
    )]
    Chunk64Unsupported(String),
    #[error(
        "the backward supports head dim 128 only, not {0} (train at this head dim with fla's Triton kernels)"
    )]
    HeadDimBackward(usize),
    #[error(
        "head dim {0} is not supported: the forward runs head dims 128 and 64 (K = V), the ones a GPU \
         run has verified"
    )]
    HeadDimUnverified(usize),
    #[error("the backward state passes take 2 or 4 warps per block, not {0}")]
    PassWarps(usize),
    #[error(
        "no backward state-pass variant with {stages} cp.async stages and {staging} staging tiles"
    )]
    PassVariant { stages: usize, staging: usize },
    #[error("workspace of {have} bytes is too small: this call needs {need} bytes")]
    WorkspaceTooSmall { need: usize, have: usize },
    #[error(
        "flashkda CUDA kernels were not built ({0}); install nvcc (e.g. `pip install --target /opt/cuda13 \
         \"cuda-toolkit[nvcc,crt,nvvm,cudart,cccl]==13.0.2\"`), set CUDA_HOME=/opt/cuda13/nvidia/cu13 and rebuild"
    )]
    KernelsNotBuilt(&'static str),
    #[error(
        "no CUDA driver: libcuda could not be loaded (no NVIDIA GPU or driver on this machine)"
    )]
    NoDriver,
    #[error(
        "cuda:{ordinal} has compute capability {major}.{minor}; the flashkda kernels need sm_90 (Hopper)"
    )]
    Arch {
        ordinal: usize,
        major: i32,
        minor: i32,
    },
    #[error("CUDA driver error during {what}: {source}")]
    Driver {
        what: &'static str,
        source: cudarc::driver::DriverError,
    },
}

impl FlashKdaError {
    /// Errors caused by the caller's arguments (as opposed to the machine or the build).
    pub fn is_invalid_argument(&self) -> bool {
        !matches!(
            self,
            Self::KernelsNotBuilt(_) | Self::NoDriver | Self::Arch { .. } | Self::Driver { .. }
        )
    }
}

pub(crate) trait DriverContext<T> {
    fn during(self, what: &'static str) -> Result<T, FlashKdaError>;
}

impl<T> DriverContext<T> for Result<T, cudarc::driver::DriverError> {
    fn during(self, what: &'static str) -> Result<T, FlashKdaError> {
        self.map_err(|source| FlashKdaError::Driver { what, source })
    }
}
