// Device barrier over all ranks through the peer-mapped control words.
#include "common.cuh"

// Barrier (kernel 1). ctrl layout (u64 words): [0, R) flags written by peers, [R] epoch,
// [R+1] status (low 32 bits). One block; thread j < R signals peer j then waits for flag j.
// Timeout writes ST_BARRIER_TIMEOUT and returns; an earlier error makes it return at once.
extern "C" __global__ void moonep_barrier(unsigned long long* ctrl, const unsigned long long* peer_ctrl,
                                          long long me, long long R, unsigned long long timeout_ns) {
  unsigned* status = reinterpret_cast<unsigned*>(ctrl + R + 1);
  __shared__ unsigned long long epoch;
  __shared__ int failed;
  if (threadIdx.x == 0) {
    epoch = ctrl[R] + 1;
    failed = (*(volatile unsigned*)status != ST_OK);
  }
  __syncthreads();
  if (failed) return;
  const unsigned long long e = epoch;
  int j = threadIdx.x;
  if (j < R) {
    __threadfence_system();
    unsigned long long* peer = reinterpret_cast<unsigned long long*>(peer_ctrl[j]);
    st_release_sys(peer + me, e);
    unsigned long long t0 = global_ns();
    while (ld_acquire_sys(ctrl + j) < e) {
      if (global_ns() - t0 > timeout_ns) {
        set_status(status, ST_BARRIER_TIMEOUT);
        break;
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) ctrl[R] = e;
}

