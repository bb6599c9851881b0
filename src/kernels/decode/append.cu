// The append of new K/V rows into their pages. The host (`paged::append_targets`) validated
// every destination (page in range, no slot written twice, lengths within the table) and
// resolved each new row to its element offset in each cache; this kernel only copies.
//
// Self-contained; needs `../common/base.cuh` (u16, u32). Elements are moved as 16-bit units
// (an f32 element is two), so one kernel serves every dtype. One CTA per new row.

struct AppendParams {
    const u16* k_new;           // [rows, heads_kv, k_units] contiguous
    const u16* v_new;           // [rows, heads_kv, v_units] contiguous
    u16* k_cache;
    u16* v_cache;
    const long long* k_dst;     // [rows]: unit offset of the row's slot (head 0) in k_cache
    const long long* v_dst;     // [rows]: in v_cache
    long long k_head_stride;    // units
    long long v_head_stride;    // units
    int rows;
    int heads_kv;
    int k_units;                // head_dim × units per element
    int v_units;
};

#define FA4_APPEND_PARAMS_SIZE 80
static_assert(sizeof(AppendParams) == FA4_APPEND_PARAMS_SIZE, "AppendParams layout must match the Rust mirror");

extern "C" __global__ void __launch_bounds__(128) fa4_paged_append(const __grid_constant__ AppendParams a) {
    const int row = blockIdx.x;
    if (row >= a.rows) return;
    const long long k_src = static_cast<long long>(row) * a.heads_kv * a.k_units;
    const long long v_src = static_cast<long long>(row) * a.heads_kv * a.v_units;
    for (int i = threadIdx.x; i < a.heads_kv * a.k_units; i += blockDim.x) {
        const int h = i / a.k_units, c = i % a.k_units;
        a.k_cache[a.k_dst[row] + h * a.k_head_stride + c] = a.k_new[k_src + i];
    }
    for (int i = threadIdx.x; i < a.heads_kv * a.v_units; i += blockDim.x) {
        const int h = i / a.v_units, c = i % a.v_units;
        a.v_cache[a.v_dst[row] + h * a.v_head_stride + c] = a.v_new[v_src + i];
    }
}
