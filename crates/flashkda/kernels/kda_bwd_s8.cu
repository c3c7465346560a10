// kda_bwd.cu with 8-token sub-chunks: half the registers for the per-token states (64 per thread,
// two blocks per SM), the second sub-chunk start of each 16-token checkpoint recomputed.
#define KDA_BWD_SUB 8
#include "kda_bwd.cu"
