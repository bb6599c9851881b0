// Pipelines between the roles of a Hopper kernel, as types. A pipeline of N stages is two
// barrier arrays, `full` (the producer's TMA completes it: one expect_tx arrival plus the bytes)
// and `empty` (the consumers release it), and each role walks it with a PipeState (stage and
// phase, one `advance`). Every barrier's phase bit flips on each completion.
//
// Producer start convention: a freshly initialised barrier counts as having completed the phase
// before phase 0 (parity 1), so the producer, which must wait for a stage to be empty before
// filling it, waits for parity `phase ^ 1` and passes at once on its first lap.
// Needs `ptx.cuh`.

// N barriers, 8 bytes apart in shared memory.
struct Barriers {
    u32 base;
    __device__ __forceinline__ u32 operator[](int s) const { return base + 8 * s; }
};

// A role's position in a ring of N stages.
template <int N>
struct PipeState {
    int stage;
    u32 phase;
    // The position of the j-th use of the ring (j counted from 0 by the role).
    __device__ __forceinline__ static PipeState at(int j) {
        return PipeState{j % N, static_cast<u32>((j / N) & 1)};
    }
    __device__ __forceinline__ void advance() {
        if (++stage == N) {
            stage = 0;
            phase ^= 1;
        }
    }
};

template <int N>
struct Pipeline {
    Barriers full, empty;
    // Producer: waits until the consumers released the stage's previous contents.
    __device__ __forceinline__ void acquire(PipeState<N> st) const { mbar_wait(empty[st.stage], st.phase ^ 1); }
    // Producer: arrives on the stage's full barrier, which then also waits for `bytes`.
    __device__ __forceinline__ void expect(PipeState<N> st, u32 bytes) const { mbar_expect_tx(full[st.stage], bytes); }
    // Consumer: waits until the stage's data has landed.
    __device__ __forceinline__ void wait(PipeState<N> st) const { mbar_wait(full[st.stage], st.phase); }
    // Consumer warp: one arrival per warp (after the warp's last read of the stage).
    __device__ __forceinline__ void release(PipeState<N> st, int lane) const {
        __syncwarp();
        if (lane == 0) mbar_arrive(empty[st.stage]);
    }
};
