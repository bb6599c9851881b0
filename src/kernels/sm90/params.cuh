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

// FP8 (the e4m3 kernel): `tv` is the 3-D map (keys, rows, heads_kv) of the Vᵀ buffer that the
// module's Vᵀ pass writes (`vt_fp8.cu`), boxes of (128 keys, head_dim_v rows, 1); sequence b's
// keys start at column cu_vt[b] (VARLEN) or b · vt_seq_keys, each sequence padded with zero
// columns to a whole number of key blocks. `descales` holds three planes of batch · heads_kv
// f32 (q, k, v), entry b · heads_kv + kv_head, `descale_plane` apart.
struct __align__(64) Sm90Params {
    TmaMap tq;
    TmaMap tk;
    TmaMap tv;
    FwdParams p;
    int tiles;  // DYNAMIC: the tiles the counter numbers (`tiles.cuh`); 0 otherwise
    int vt_seq_keys;            // FP8, fixed-length: Vᵀ columns per sequence
    const int* cu_vt;           // FP8, VARLEN: [batch + 1] first Vᵀ column of each sequence
    const float* descales;      // FP8: [3][batch][heads_kv]
    int descale_plane;          // FP8: batch · heads_kv
    int pad0;
    TmaMap to;  // O: boxes of (64, 64 rows, 1 slab) for the TMA-store epilogue (TMA_STORE), 4-D with SLAB_MAPS_V
};

#define FA4_SM90_PARAMS_SIZE 768
static_assert(sizeof(Sm90Params) == FA4_SM90_PARAMS_SIZE, "Sm90Params layout must match the Rust mirror");
