// Launch parameters of the Hopper forward kernel: four TMA maps (Q, K, V; O for the TMA store) (built on the host by
// cuTensorMapEncodeTiled, opaque here) and the common FwdParams (`../common/params.cuh`).
// Mirrored by `cuda::params::Sm90Params` (Rust); both sides assert the size.
// A map must sit at a 64-byte aligned address: the struct and each map are aligned so.

// Q, K and V are each seen as a 5-D tensor, innermost first:
//   (64 columns of a slab, rows, head_dim / 64 slabs, heads, batch)
// with byte strides (row, 128, head, batch), so that one box of (64, rows, slabs, 1, 1)
// lands in shared memory as `slabs` swizzled (rows, 64) tiles: the wgmma operand layout.
// A tensor narrower than its tile (SLAB_MAPS_QK, SLAB_MAPS_V) is seen in 4-D instead,
//   (head_dim columns, rows, heads, batch), with boxes of (64, rows, 1, 1), one per slab.
struct __align__(64) TmaMap {
    u64 opaque[16];
};

struct __align__(64) Sm90Params {
    TmaMap tq;
    TmaMap tk;
    TmaMap tv;
    FwdParams p;
    int tiles;  // DYNAMIC: the tiles the counter numbers (`tiles.cuh`); 0 otherwise
    TmaMap to;  // O: boxes of (64, 64 rows, 1 slab) for the TMA-store epilogue (TMA_STORE), 4-D with SLAB_MAPS_V
};

#define FA4_SM90_PARAMS_SIZE 768
static_assert(sizeof(Sm90Params) == FA4_SM90_PARAMS_SIZE, "Sm90Params layout must match the Rust mirror");
