// The workspace schedule of kda_fwd_ws.cu with split (hi + lo bf16) operands at the rounding
// points that cost accuracy (`reference::emulated::Rounding::SPLIT`): same kernels, same names, a
// 14400-byte record (M's lo part added).
#define KDA_SPLIT_OPERANDS 1
#include "kda_fwd_ws.cu"
