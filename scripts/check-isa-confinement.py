#!/usr/bin/env python3
"""Checks the rule "no instruction of an ISA the CPU may lack runs outside a dispatched call"
(docs/design.md, "ISA confinement") on x86-64 object files, libraries and executables.

Every function in the given ELF files is disassembled (objdump). A function that holds an
instruction beyond the x86-64 baseline (SSE2) -- any VEX/EVEX-encoded instruction (AVX, AVX2,
FMA, F16C, AVX-512), a ymm/zmm/mask register, AMX, BMI1/2, LZCNT/POPCNT/MOVBE, SSSE3/SSE4 -- must
belong to a scope that only dispatched calls enter:

  - Highway's per-target namespaces (N_AVX2, N_AVX3, ...: HWY_NAMESPACE), which dispatch reaches
    through HWY_DYNAMIC_DISPATCH only after checking the CPU;
  - the intrinsic kernels of tokenmix::kernels::amx and tokenmix::kernels::dpbf16, called only
    from the AVX-512 kernels, and only where CpuFeatures says the CPU has AMX / AVX512-BF16.

Anything else is a violation: it can run on a CPU that lacks the ISA. The two ways it happens,
both caught here:
  - a namespace-scope object's dynamic initializer (_GLOBAL__sub_I_*) compiled with ISA flags,
    run by the loader before any dispatch;
  - an inline function or template from a shared header (the STL included) instantiated in a
    file compiled with ISA flags: a weak symbol the linker may pick for every caller.

Usage: check-isa-confinement.py FILE... (object files, .so, executables with their symbol
table: a stripped file is refused, since its code cannot be told apart by function). Exit status
0 when nothing is found, 1 on a violation (each printed with the file, the function, whether it
is a weak symbol, and its first offending instruction), 2 on a usage error, a stripped file or a
missing tool.
"""
import re
import shutil
import subprocess
import sys

# Scopes (qualified-name prefixes, template arguments removed) whose code runs only after dispatch.
# A new intrinsic file (functions under HWY_PUSH_ATTRIBUTES, called only from a dispatched kernel)
# puts its functions in a namespace of its own and adds that namespace here.
DISPATCHED_SCOPES = re.compile(
    r"(^|::)N_(AVX2|AVX3|AVX3_DL|AVX3_ZEN4|AVX3_SPR)::"
    r"|^tokenmix::kernels::amx::"
    r"|^tokenmix::kernels::dpbf16::")

REGISTER_BEYOND_BASELINE = re.compile(r"%(ymm|zmm)\d+|%k[0-7]\b|%tmm[0-7]\b")
MNEMONIC_BEYOND_BASELINE = re.compile(
    r"^(v(?!err|erw)[a-z0-9]+"  # VEX / EVEX: AVX, AVX2, FMA, F16C, AVX-512 (not VERR/VERW)
    r"|ldtilecfg|sttilecfg|tile[a-z]+|tdp[a-z0-9]+"  # AMX
    r"|andn|bextr|blsi|blsmsk|blsr|bzhi|mulx|pdep|pext|rorx|sarx|shlx|shrx"  # BMI1 / BMI2
    # (not TZCNT: GCC emits it for __builtin_ctz as REP BSF, which CPUs without BMI1 run as BSF,
    # with the same result for a nonzero input)
    r"|lzcnt|popcnt|movbe"
    r"|pshufb|phadd[a-z]*|phsub[a-z]*|pmaddubsw|pmulhrsw|palignr|psign[bwd]|pabs[bwd]"  # SSSE3
    r"|pmulld|pmuldq|ptest|round[ps][sd]|blendv?p[sd]|pblend[a-z]*|pminsd|pmaxsd|pminu[dw]"
    r"|pmaxu[dw]|pins[rbdq]*|pextr[bdq]|pmov[sz]x[a-z]+|packusdw|pcmpeqq|pcmpgtq|dpp[sd]"
    r"|insertps|extractps|mpsadbw|phminposuw|pcmp[ei]str[im]|crc32[bwlq]?)$")


def demangled_scope(name):
    """The qualified name of a function, without template arguments, parameters or clones."""
    name = re.sub(r" \[clone [^\]]*\]", "", name)
    out, depth = [], 0
    for ch in name:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(depth - 1, 0)
        elif ch == "(" and depth == 0:
            break
        elif depth == 0:
            out.append(ch)
    scope = "".join(out).strip()
    # Return types of template functions come first ("float ns::f"): keep the last word.
    return scope.split(" ")[-1] if " " in scope else scope


def weak_symbols(path):
    result = subprocess.run(["nm", "-C", "--defined-only", path], capture_output=True, text=True)
    weak = set()
    for line in result.stdout.splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[1] in ("W", "V", "u"):
            weak.add(parts[2])
    return weak


def has_symbol_table(path):
    """A stripped file's code cannot be attributed to functions: objdump labels it with the
    nearest exported symbol."""
    result = subprocess.run(["readelf", "-S", "-W", path], capture_output=True, text=True)
    return result.returncode == 0 and " .symtab " in result.stdout


def check(path):
    if not has_symbol_table(path):
        print(f"check-isa-confinement: {path} is stripped (no .symtab): its code cannot be "
              "attributed to functions; check the objects it was linked from", file=sys.stderr)
        return None
    result = subprocess.run(["objdump", "-d", "-C", "-w", "--no-show-raw-insn", path],
                            capture_output=True, text=True)
    if result.returncode != 0:
        print(f"check-isa-confinement: objdump failed on {path}: {result.stderr.strip()}",
              file=sys.stderr)
        return None
    weak = weak_symbols(path)
    violations = []
    function, reported = None, False
    for line in result.stdout.splitlines():
        header = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if header:
            function, reported = header.group(1), False
            continue
        if function is None or reported:
            continue
        fields = line.split("\t")
        if len(fields) < 2:
            continue
        instruction = fields[-1].strip()
        mnemonic = instruction.split(" ")[0]
        if mnemonic.startswith(("rex", "lock", "rep", "notrack", "bnd", "data16", "cs", "ds")):
            mnemonic = instruction.split(" ")[1] if " " in instruction else mnemonic
        if not (MNEMONIC_BEYOND_BASELINE.match(mnemonic) or
                REGISTER_BEYOND_BASELINE.search(instruction)):
            continue
        reported = True
        if DISPATCHED_SCOPES.search(demangled_scope(function)):
            continue
        base = re.sub(r" \[clone [^\]]*\]$", "", function)
        kind = "weak symbol" if base in weak else "function"
        violations.append(f"{path}: {kind} {function}: {instruction}")
    return violations


def main(argv):
    if len(argv) < 2:
        print("usage: check-isa-confinement.py FILE...", file=sys.stderr)
        return 2
    for tool in ("objdump", "nm", "readelf"):
        if shutil.which(tool) is None:
            print(f"check-isa-confinement: {tool} (binutils) is not installed", file=sys.stderr)
            return 2
    found, files = [], 0
    for path in argv[1:]:
        violations = check(path)
        if violations is None:
            return 2
        files += 1
        found += violations
    for v in found:
        print(v)
    if found:
        print(f"check-isa-confinement: {len(found)} function(s) in {files} file(s) run "
              "instructions beyond x86-64 outside a dispatched scope (docs/design.md, "
              "\"ISA confinement\")", file=sys.stderr)
        return 1
    print(f"check-isa-confinement: {files} file(s), no instruction beyond x86-64 outside a "
          "dispatched scope")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
