#!/usr/bin/env bash
# Compares two dumps of every kernel variant's cubin (tests/sass_dump.rs) instruction by
# instruction: for each variant present in both, the disassembled code sections (nvdisasm -c,
# addresses, encodings and comments removed) must be equal. Prints one line per variant that
# differs and a summary; exits 1 if any differs or a variant is missing from NEW.
#   bench/sass_diff.sh OLD_DIR NEW_DIR
# nvdisasm: from PATH, or $NVDISASM (pip nvidia-cuda-nvdisasm ships one under nvidia/cu13/bin).
set -euo pipefail
old=$1 new=$2
nvdisasm=${NVDISASM:-nvdisasm}
same=0 differ=0 missing=0
sass() { "$nvdisasm" -c -hex "$1" | sed -e 's@/\*[0-9a-f]\{4,\}\*/@@g' -e 's@/\* 0x[0-9a-f]* \*/@@g' -e 's/[[:space:]]\+$//' | grep -v '^[[:space:]]*$'; }
for f in "$old"/*.cubin; do
    name=$(basename "$f")
    if [ ! -e "$new/$name" ]; then
        echo "missing in $new: $name"
        missing=$((missing + 1))
        continue
    fi
    if cmp -s <(sass "$f") <(sass "$new/$name"); then
        same=$((same + 1))
    else
        echo "differs: $name ($(diff <(sass "$f") <(sass "$new/$name") | grep -c '^[<>]') lines)"
        differ=$((differ + 1))
    fi
done
echo "sass_diff: $same identical, $differ differ, $missing missing"
[ "$differ" -eq 0 ] && [ "$missing" -eq 0 ]
