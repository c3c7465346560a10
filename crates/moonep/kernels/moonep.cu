// moonep GPU kernels (docs/specs/moonep.md §2, §3, §5): one file per phase, one translation unit
// and one sm_90a cubin (build.rs). Every kernel has a CPU reference: the planner in src/plan/,
// dispatch, combine and their backward in src/reference/. Each kernel has one typed launcher in
// src/gpu/kernels.rs whose fields follow the parameter list here.
#include "common.cuh"
#include "barrier.cu"
#include "layout.cu"
#include "dispatch.cu"
#include "combine.cu"
#include "weights.cu"
#include "fallback.cu"
#include "baseline.cu"
