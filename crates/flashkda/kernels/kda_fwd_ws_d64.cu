// The workspace schedule of kda_fwd_ws.cu at head dim 64 (K = V = 64): same kernels and names
// except kda_state_w8 (a chain has 4 warps of value rows), a 7488-byte record.
#define KD 64
#include "kda_fwd_ws.cu"
