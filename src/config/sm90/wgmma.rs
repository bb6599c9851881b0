//! `wgmma` wrappers, generated: an inline-asm operand list (one `"+f"` per accumulator register)
//! cannot be produced by a C++ template, so the planner writes one wrapper per instruction shape
//! a kernel asks for. M is always 64 (the only wgmma M); N, the A operand's source, the B
//! operand's major-ness and the dtype are parameters.

/// Where a `wgmma`'s A operand comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OperandA {
    /// Shared memory, through a descriptor (K-major).
    Smem,
    /// Registers: four 32-bit registers per thread (16-bit: packed pairs in the accumulator
    /// layout; e4m3: four bytes each, consecutive k).
    Regs,
    /// Registers, as [`OperandA::Regs`], with an `accumulate` argument like the shared-memory
    /// form's (0: D = A·B, the old D not read).
    RegsScaled,
}

/// One `wgmma.mma_async` shape: m64 n`n` k16 (16-bit operands) or k32 (e4m3), f32 accumulators.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wgmma {
    /// The C++ function's name.
    pub name: &'static str,
    /// N: a multiple of 8 from 8 to 256.
    pub n: usize,
    /// The A operand's source.
    pub a: OperandA,
    /// bf16 (true) or fp16 operands.
    pub bf16: bool,
    /// B is MN-major (transposed): V in O += P·V. 16-bit only: e4m3 operands are K-major.
    pub b_transposed: bool,
    /// e4m3 operands (k32; `bf16` is then ignored). The hardware takes 8-bit operands K-major
    /// only, so there are no transpose immediates.
    pub e4m3: bool,
}

impl Wgmma {
    /// The wrapper. From shared memory: `name(d, desc_a, desc_b, accumulate)`, where
    /// `accumulate` = 0 overwrites D. From registers: `name(d, a0, a1, a2, a3, desc_b)`, always
    /// accumulating.
    pub fn wrapper(&self) -> String {
        assert!(
            self.n.is_multiple_of(8) && (8..=256).contains(&self.n),
            "wgmma N {} is not a multiple of 8 in 8..=256",
            self.n
        );
        assert!(
            !(self.e4m3 && self.b_transposed),
            "e4m3 wgmma operands are K-major"
        );
        let (name, n) = (self.name, self.n);
        let (ty, k) = match (self.e4m3, self.bf16) {
            (true, _) => ("e4m3", 32),
            (false, true) => ("bf16", 16),
            (false, false) => ("f16", 16),
        };
        // 16-bit operands take the transpose immediates (A never transposed); 8-bit ones none.
        let (ss_tail, rs_tail) = if self.e4m3 {
            (String::new(), String::new())
        } else {
            (
                format!(", 0, {}", u8::from(self.b_transposed)),
                format!(", {}", u8::from(self.b_transposed)),
            )
        };
        let half = n / 2;
        let list: Vec<String> = (0..half).map(|i| format!("%{i}")).collect();
        let list = list.join(", ");
        let outs: Vec<String> = (0..half).map(|i| format!("\"+f\"(d[{i}])")).collect();
        let outs = outs.join(", ");
        match self.a {
            OperandA::Smem => format!(
                "__device__ __forceinline__ void {name}(float (&d)[{half}], u64 desc_a, u64 desc_b, int accumulate) {{\n\
                 \x20   asm volatile(\"{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{acc}, 0;\\n\"\n\
                 \x20                \"wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{ty}.{ty} {{{list}}}, %{a}, %{b}, p, 1, 1{ss_tail};\\n}}\\n\"\n\
                 \x20                : {outs}\n\
                 \x20                : \"l\"(desc_a), \"l\"(desc_b), \"r\"(accumulate));\n\
                 }}\n",
                a = half,
                b = half + 1,
                acc = half + 2,
            ),
            OperandA::RegsScaled => format!(
                "__device__ __forceinline__ void {name}(float (&d)[{half}], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc_b, int accumulate) {{\n\
                 \x20   asm volatile(\"{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{acc}, 0;\\n\"\n\
                 \x20                \"wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{ty}.{ty} {{{list}}}, {{%{a0}, %{a1}, %{a2}, %{a3}}}, %{b}, p, 1, 1{rs_tail};\\n}}\\n\"\n\
                 \x20                : {outs}\n\
                 \x20                : \"r\"(a0), \"r\"(a1), \"r\"(a2), \"r\"(a3), \"l\"(desc_b), \"r\"(accumulate));\n\
                 }}\n",
                a0 = half,
                a1 = half + 1,
                a2 = half + 2,
                a3 = half + 3,
                b = half + 4,
                acc = half + 5,
            ),
            OperandA::Regs => format!(
                "__device__ __forceinline__ void {name}(float (&d)[{half}], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc_b) {{\n\
                 \x20   asm volatile(\"wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{ty}.{ty} {{{list}}}, {{%{a0}, %{a1}, %{a2}, %{a3}}}, %{b}, 1, 1, 1{rs_tail};\\n\"\n\
                 \x20                : {outs}\n\
                 \x20                : \"r\"(a0), \"r\"(a1), \"r\"(a2), \"r\"(a3), \"l\"(desc_b));\n\
                 }}\n",
                a0 = half,
                a1 = half + 1,
                a2 = half + 2,
                a3 = half + 3,
                b = half + 4,
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrappers_list_every_accumulator_and_the_operands() {
        let ss = Wgmma {
            name: "mma_s",
            n: 176,
            a: OperandA::Smem,
            bf16: true,
            b_transposed: false,
            e4m3: false,
        }
        .wrapper();
        assert!(ss.contains("void mma_s(float (&d)[88], u64 desc_a"));
        assert!(ss.contains("m64n176k16.f32.bf16.bf16 {%0, %1,"));
        assert!(ss.contains("%87}, %88, %89, p, 1, 1, 0, 0;"));
        assert!(ss.contains("setp.ne.b32 p, %90, 0;"));
        assert_eq!(ss.matches("\"+f\"").count(), 88);
        let rs = Wgmma {
            name: "mma_o",
            n: 64,
            a: OperandA::Regs,
            bf16: false,
            b_transposed: true,
            e4m3: false,
        }
        .wrapper();
        assert!(rs.contains("m64n64k16.f32.f16.f16 {%0,"));
        assert!(rs.contains("%31}, {%32, %33, %34, %35}, %36, 1, 1, 1, 1;"));
        let scaled = Wgmma {
            name: "mma_o_acc",
            n: 64,
            a: OperandA::RegsScaled,
            bf16: true,
            b_transposed: true,
            e4m3: false,
        }
        .wrapper();
        assert!(scaled.contains("u64 desc_b, int accumulate)"));
        assert!(scaled.contains("setp.ne.b32 p, %37, 0;"));
        assert!(scaled.contains("%31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;"));
        // e4m3: k32, no transpose immediates, on both forms.
        let f8 = Wgmma {
            name: "mma_s8",
            n: 128,
            a: OperandA::Smem,
            bf16: true,
            b_transposed: false,
            e4m3: true,
        }
        .wrapper();
        assert!(f8.contains("m64n128k32.f32.e4m3.e4m3 {%0,"));
        assert!(f8.contains("%63}, %64, %65, p, 1, 1;"), "{f8}");
        let f8 = Wgmma {
            name: "mma_o8",
            n: 64,
            a: OperandA::Regs,
            bf16: true,
            b_transposed: false,
            e4m3: true,
        }
        .wrapper();
        assert!(
            f8.contains("%31}, {%32, %33, %34, %35}, %36, 1, 1, 1;"),
            "{f8}"
        );
    }
}
