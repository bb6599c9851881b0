// Launch parameters of the Hopper backward's main kernel: four TMA maps (Q, K, V, dO; built on
// the host by cuTensorMapEncodeTiled, `cuda::tma::encode`, opaque here) around the backward's
// params (`../bwd/params.cuh`). Mirrored by `cuda::backward_sm90::Sm90BwdParams` (Rust); both
// sides assert the size. A map must sit at a 64-byte aligned address: the struct is aligned so.
// Needs `../sm90/params.cuh` (TmaMap) and `../bwd/params.cuh` (BwdParams).

struct __align__(64) Sm90BwdParams {
    TmaMap tq;   // Q:  boxes of (64, BLOCK_M, HEAD_DIM / 64, 1, 1)
    TmaMap tk;   // K:  boxes of (64, BLOCK_N, HEAD_DIM / 64, 1, 1)
    TmaMap tv;   // V:  as K
    TmaMap tdo;  // dO: as Q
    BwdParams b;
};

#define FA4_SM90_BWD_PARAMS_SIZE 960
static_assert(sizeof(Sm90BwdParams) == FA4_SM90_BWD_PARAMS_SIZE, "Sm90BwdParams layout must match the Rust mirror");
