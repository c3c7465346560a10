// kda_fwd_ws_split.cu at head dim 64 (K = V = 64): split (hi + lo bf16) operands, an 8000-byte
// record, the kernels of kda_fwd_ws_d64.cu.
#define KD 64
#define KDA_SPLIT_OPERANDS 1
#include "kda_fwd_ws.cu"
