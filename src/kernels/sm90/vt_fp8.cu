// The e4m3 Hopper kernel's Vᵀ pass: a second entry of its module, launched on the same stream
// before the forward. The hardware takes 8-bit wgmma operands K-major only, so P·V needs V with
// the keys contiguous: this pass writes Vᵀ, [heads_kv][O_DIM rows][total columns] bytes, from V
// (the problem's layout). Sequence b's keys start at column cu_vt[b] (VARLEN) or
// b · vt_seq_keys, and its columns are padded with zeros to whole key blocks (BLOCK_N), so a key
// block never holds another sequence's V and a padded column adds P = 0 times 0.
//
// Inside each group of 32 columns the keys are stored in the order the forward's P registers
// hold them (`pack_p` in fwd.cu): column 16h + 4c + j holds key 16h + 8(j / 2) + 2c + j % 2 of
// the group (h < 2, c < 4, j < 4).
//
// It also gathers the descales into the one buffer the forward and its fixup read: CTA (0, 0)
// copies the three arrays (ones where one is absent), and a descale that is not finite and
// positive becomes NaN there, so that every row it scales comes out NaN rather than silently
// wrong (device descales are not read back to the host; host callers' are checked before).
//
// One CTA per (128-column chunk, KV head): it stages the chunk's 128 V rows (O_DIM bytes each,
// zeros past the sequence) in shared memory, 8 bytes per global read, then a warp writes each of
// the O_DIM Vᵀ rows' 128 bytes, 4 per lane. Every column of the buffer is written, padding
// included.

struct VtParams {
    const unsigned char* v;      // the problem's V (e4m3)
    unsigned char* vt;           // [heads_kv][O_DIM][total_cols]
    const int* cu_seqlens_k;     // VARLEN: [batch + 1]
    const int* cu_vt;            // VARLEN: [batch + 1] first column of each sequence
    const float* q_descale;      // [batch][heads_kv] each, or null (ones)
    const float* k_descale;
    const float* v_descale;
    float* descales;             // written: [3][batch][heads_kv], the forward's `Sm90Params::descales`
    long long v_batch_stride, v_row_stride, v_head_stride;  // elements (= bytes)
    int batch;
    int seqlen_k;                // fixed-length
    int vt_seq_keys;             // fixed-length: columns per sequence
    int total_cols;              // a multiple of 128
    int descale_plane;           // batch · heads_kv
    int pad0;
};
#define FA4_VT_PARAMS_SIZE 112
static_assert(sizeof(VtParams) == FA4_VT_PARAMS_SIZE, "VtParams layout must match the Rust mirror");

constexpr int VT_THREADS = 256;
constexpr int VT_CHUNK = 128;  // columns per CTA: a whole number of 32-key groups, inside one sequence
// A staged row's bytes: O_DIM and one more word, so that rows whose keys differ mod 32 fall in
// different banks (a row is O_DIM / 4 + 1 words).
constexpr int ROW_BYTES = O_DIM + 4;

// The key (within its group of 32) that column `a` of the group holds.
__device__ __forceinline__ int vt_key(int a) {
    const int h = a >> 4, c = (a >> 2) & 3, j = a & 3;
    return 16 * h + 8 * (j >> 1) + 2 * c + (j & 1);
}

extern "C" __global__ void __launch_bounds__(VT_THREADS) fa4_vt_fp8(const VtParams P) {
    __shared__ __align__(16) unsigned char rows[VT_CHUNK * ROW_BYTES];
    if (blockIdx.x == 0 && blockIdx.y == 0) {
        for (int i = threadIdx.x; i < 3 * P.descale_plane; i += VT_THREADS) {
            const int op = i / P.descale_plane, at = i % P.descale_plane;
            const float* src = op == 0 ? P.q_descale : op == 1 ? P.k_descale : P.v_descale;
            const float d = src != nullptr ? src[at] : 1.0f;
            P.descales[i] = d > 0.0f && d <= 3.4028235e38f ? d : __int_as_float(0x7fffffff);
        }
    }
    const int col0 = blockIdx.x * VT_CHUNK;
    const int kv_head = blockIdx.y;
    // The sequence whose columns hold col0 (sequences' column ranges are whole chunks).
    int b, first;
    if constexpr (VARLEN) {
        int lo = 0, hi = P.batch - 1;  // the last b with cu_vt[b] <= col0
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (P.cu_vt[mid] <= col0)
                lo = mid;
            else
                hi = mid - 1;
        }
        b = lo;
        first = P.cu_vt[b];
    } else {
        b = col0 / P.vt_seq_keys;
        first = b * P.vt_seq_keys;
    }
    const int k_start = VARLEN ? P.cu_seqlens_k[b] : 0;
    const int k_len = VARLEN ? P.cu_seqlens_k[b + 1] - k_start : P.seqlen_k;
    const int key0 = col0 - first;  // the chunk's first key in its sequence
    const unsigned char* src = P.v + (VARLEN ? 0 : b * P.v_batch_stride) + (long long)k_start * P.v_row_stride +
                               kv_head * P.v_head_stride;
    // Stage: row r of the chunk (key key0 + r) at rows + r · ROW_BYTES, 8 bytes read at a time.
    constexpr int WORDS = O_DIM / 8;
    for (int i = threadIdx.x; i < VT_CHUNK * WORDS; i += VT_THREADS) {
        const int r = i / WORDS, w = i % WORDS;
        const int key = key0 + r;
        unsigned long long x = 0;
        if (key < k_len) x = *reinterpret_cast<const unsigned long long*>(src + key * P.v_row_stride + 8 * w);
        u32* at = reinterpret_cast<u32*>(rows + r * ROW_BYTES + 8 * w);
        at[0] = static_cast<u32>(x);
        at[1] = static_cast<u32>(x >> 32);
    }
    __syncthreads();
    // Write: warp w takes Vᵀ rows d = w, w + 8, …; lane l the 4 columns 4l .. 4l + 3 of the chunk,
    // so that a warp stores one row's 128 bytes at once. Byte j of lane l's word is key
    // 32·(l / 8) + vt_key(4·(l % 8) + j): for one j the warp's 32 rows fall in only 8 banks, so
    // lane l reads its bytes in the order j = (t + l / 8) % 4, t = 0 … 3, and at each step the
    // four groups of 8 lanes read bytes j that hold disjoint key residues (`vt_key`): 32 banks.
    unsigned char* dst = P.vt + (long long)kv_head * O_DIM * P.total_cols + col0;
    const int lane = threadIdx.x % 32;
    for (int d = threadIdx.x / 32; d < O_DIM; d += VT_THREADS / 32) {
        u32 x = 0;
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const int j = (t + lane / 8) & 3;
            const int row = 32 * (lane / 8) + vt_key(4 * (lane % 8) + j);
            x |= static_cast<u32>(rows[row * ROW_BYTES + d]) << (8 * j);
        }
        st_global_b32(dst + (long long)d * P.total_cols + 4 * lane, x);
    }
}
