// Register-tile steps of the mma.sync m16n8k16 attention loop that the Ampere-class forward
// (`fwd.cu`) and the split-KV decode kernel (`../decode/splitkv.cu`) share: the O rescale by
// the rows' correction factors, the packing of P into A fragments and the P·V product. Needs
// `../common/base.cuh` (pack2) and `ptx.cuh` (ldmatrix, mma). Templates over the tile counts;
// the kernels' own V layout enters as an address function.
//
// Layouts (the m16n8k16 accumulator): a thread holds, of MMA tile mt, rows g and g + 8 (g =
// lane / 4) and columns 2t, 2t + 1 (t = lane % 4) of each n8 tile i: rX[mt][i][0..1] on row g,
// rX[mt][i][2..3] on row g + 8. Row slot 2·mt + h is row g + 8h of tile mt.

// O *= corr, per row slot: (16·MT, 8·ND) accumulator, corr[2·mt + h].
template <int MT, int ND>
__device__ __forceinline__ void rescale_o(float (&rO)[MT][ND][4], const float (&corr)[2 * MT]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < ND; ++i) {
            rO[mt][i][0] *= corr[2 * mt];
            rO[mt][i][1] *= corr[2 * mt];
            rO[mt][i][2] *= corr[2 * mt + 1];
            rO[mt][i][3] *= corr[2 * mt + 1];
        }
}

// One k16 step of O += P·V, step 1: keys 16·ks .. 16·ks + 15 of P (S's f32 accumulator,
// (16·MT, 8·NT)) packed to 16 bits: the m16n8k16 A-fragment layout is S's accumulator layout,
// so P never leaves registers.
template <int MT, int NT>
__device__ __forceinline__ void pack_p(u32 (&pa)[MT][4], const float (&rS)[MT][NT][4], int ks) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        pa[mt][0] = pack2(rS[mt][2 * ks][0], rS[mt][2 * ks][1]);
        pa[mt][1] = pack2(rS[mt][2 * ks][2], rS[mt][2 * ks][3]);
        pa[mt][2] = pack2(rS[mt][2 * ks + 1][0], rS[mt][2 * ks + 1][1]);
        pa[mt][3] = pack2(rS[mt][2 * ks + 1][2], rS[mt][2 * ks + 1][3]);
    }
}

// Step 2: O (16·MT, 8·ND) += pa · V's 16 rows of the step. v_addr(dp) is the shared address this
// lane gives ldmatrix.trans for the fragment of V's columns 16·dp .. 16·dp + 15.
//
// The kernels keep the loop over ks themselves: with that loop inside a helper too, NVRTC 13.0
// allocated registers differently in 24 of the sm80 forward's 64 sm_80/sm_90a variants (same
// instructions, other order); this split leaves them all identical (bench/sass_diff.sh).
template <int MT, int ND, class VAddr>
__device__ __forceinline__ void pv_k16(float (&rO)[MT][ND][4], const u32 (&pa)[MT][4], VAddr v_addr) {
#pragma unroll
    for (int dp = 0; dp < ND / 2; ++dp) {
        u32 b[4];
        ldmatrix_x4_trans(b, v_addr(dp));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            mma_16816(rO[mt][2 * dp], pa[mt], b[0], b[1]);
            mma_16816(rO[mt][2 * dp + 1], pa[mt], b[2], b[3]);
        }
    }
}
