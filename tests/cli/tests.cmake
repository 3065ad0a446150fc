# tests/cli/tests.cmake — tests of the `tokenmix` command-line tool (included from
# tests/CMakeLists.txt). Each test runs the built tool through run_cli.cmake, which checks the
# exit code, stdout/stderr patterns, that error cases print exactly one stderr line and write
# nothing, and optionally runs npy_tool to compare written .npy files with the float64 oracle.
if(NOT TARGET tokenmix_cli)
  return()  # TOKENMIX_BUILD_CLI=OFF
endif()

add_executable(tokenmix_cli_npy_tool ${CMAKE_CURRENT_LIST_DIR}/npy_tool.cpp)
target_link_libraries(tokenmix_cli_npy_tool PRIVATE tokenmix_io tokenmix_reference)

# Runs `tokenmix bench ... --json` and checks its JSON lines against each other (issue 16).
add_executable(tokenmix_cli_bench_json_check ${CMAKE_CURRENT_LIST_DIR}/bench_json_check.cpp)

# The bench's rule for warning that its sgemm ceiling is below the CPU's, for given CPUs.
add_executable(tokenmix_cli_bench_ceiling_check ${CMAKE_CURRENT_LIST_DIR}/bench_ceiling_check.cpp)
target_link_libraries(tokenmix_cli_bench_ceiling_check PRIVATE tokenmix_bench)
add_test(NAME cli_bench_ceiling_warning_rule COMMAND tokenmix_cli_bench_ceiling_check)
set_tests_properties(cli_bench_ceiling_warning_rule PROPERTIES LABELS cli)

set(TOKENMIX_CLI_DRIVER ${CMAKE_CURRENT_LIST_DIR}/run_cli.cmake)
set(TOKENMIX_CLI_DIR ${CMAKE_CURRENT_BINARY_DIR}/cli)
set(TOKENMIX_CLI_NPY_TOOL $<TARGET_FILE:tokenmix_cli_npy_tool>)

# tokenmix_cli_test(NAME ARGS <args...> [EXPECT_RC n] [STDOUT re] [STDOUT_NOT re] [STDERR re]
#                   [ONE_LINE_ERROR] [NOT_EXIST <paths...>] [CLEAN <paths...>]
#                   [POST <command...>] [COPY <src dst>...] [UNCHANGED <paths...>]
#                   [NO_GLOB <patterns...>] [WORKDIR dir]
#                   [FIXTURES <fixture>] [TIMEOUT s])
function(tokenmix_cli_test name)
  cmake_parse_arguments(PARSE_ARGV 1 T "ONE_LINE_ERROR"
                        "EXPECT_RC;STDOUT;STDOUT_NOT;STDERR;FIXTURES;TIMEOUT;WORKDIR"
                        "ARGS;NOT_EXIST;CLEAN;POST;COPY;UNCHANGED;NO_GLOB")
  list(JOIN T_ARGS "|" args)
  set(defs -DTOOL=$<TARGET_FILE:tokenmix_cli> "-DARGS=${args}")
  if(DEFINED T_EXPECT_RC)
    list(APPEND defs -DEXPECT_RC=${T_EXPECT_RC})
  endif()
  foreach(key STDOUT STDOUT_NOT STDERR)
    if(DEFINED T_${key})
      list(APPEND defs "-D${key}_REGEX=${T_${key}}")
    endif()
  endforeach()
  if(T_ONE_LINE_ERROR)
    list(APPEND defs -DONE_LINE_ERROR=ON)
  endif()
  if(T_NOT_EXIST)
    list(JOIN T_NOT_EXIST "|" paths)
    list(APPEND defs "-DNOT_EXIST=${paths}")
  endif()
  if(T_CLEAN)
    list(JOIN T_CLEAN "|" paths)
    list(APPEND defs "-DCLEAN=${paths}")
  endif()
  if(T_POST)
    list(JOIN T_POST "|" post)
    list(APPEND defs "-DPOST=${post}")
  endif()
  foreach(key COPY UNCHANGED NO_GLOB)
    if(T_${key})
      list(JOIN T_${key} "|" joined)
      list(APPEND defs "-D${key}=${joined}")
    endif()
  endforeach()
  if(DEFINED T_WORKDIR)
    list(APPEND defs "-DWORKDIR=${T_WORKDIR}")
  endif()
  add_test(NAME cli_${name} COMMAND ${CMAKE_COMMAND} ${defs} -P ${TOKENMIX_CLI_DRIVER})
  if(NOT DEFINED T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  set_tests_properties(cli_${name} PROPERTIES TIMEOUT ${T_TIMEOUT} LABELS cli)
  if(DEFINED T_FIXTURES)
    set_tests_properties(cli_${name} PROPERTIES FIXTURES_REQUIRED ${T_FIXTURES})
  endif()
endfunction()

# --- help, info, check, the built-in run -------------------------------------------------------
tokenmix_cli_test(help ARGS --help STDOUT "run.*check.*info")
tokenmix_cli_test(run_help ARGS run --help STDOUT "--seq.*--q .*--dout")
tokenmix_cli_test(run_help_variants ARGS run --help
                  STDOUT "--dsinks.*--window.*--softcap.*--alibi.*--sinks.*H_q comma-separated")
tokenmix_cli_test(bench_help_variants ARGS bench --help
                  STDOUT "--window.*--softcap.*--alibi.*2\\^\\(-8\\(h\\+1\\)/H_q\\).*--sinks")
tokenmix_cli_test(check_help ARGS check --help STDOUT "--isa")
tokenmix_cli_test(info_help ARGS info --help STDOUT "info")
tokenmix_cli_test(info ARGS info
                  STDOUT "tokenmix [0-9]+\\.[0-9]+\\.[0-9]+.*cpu:.*available paths: portable.*kernel path: .*fp8 cache: +(direct widening into fp32 bits|widening through f16 bits) on [a-z0-9_]+ \\((automatic|TOKENMIX_FP8_WIDEN=[a-z0-9]+)\\).*decode prefetch: (address order for every cache dtype|address order for f32, the others row by row|address order for f32/bf16/f16, int8/fp8 row by row|row by row) on [a-z0-9_]+ \\((automatic|TOKENMIX_LINEAR_PREFETCH=[a-z-]+)\\).*threads: +[1-9]")
# TOKENMIX_LINEAR_PREFETCH: `tokenmix info` names a forced choice; a bad value is one line on
# stderr and exit 2, before any output.
tokenmix_cli_test(info_linear_prefetch_forced ARGS info
                  STDOUT "decode prefetch: (address order for f32, the others row by row|address order for f32/bf16/f16, int8/fp8 row by row|row by row) on [a-z0-9_]+ \\(TOKENMIX_LINEAR_PREFETCH=per-dtype\\)")
set_tests_properties(cli_info_linear_prefetch_forced PROPERTIES
                     ENVIRONMENT "TOKENMIX_LINEAR_PREFETCH=per-dtype")
# The tuning is the resolved path's registry entry's (dispatch/registry.cpp): the portable path
# has neither the direct fp8 reading nor the prefetch cursor, whatever the switches ask.
tokenmix_cli_test(info_portable_decode_tuning ARGS info
                  STDOUT "kernel path:     portable .*fp8 cache:       widening through f16 bits on portable \\(TOKENMIX_FP8_WIDEN=direct\\).*decode prefetch: row by row on portable \\(TOKENMIX_LINEAR_PREFETCH=all\\)")
set_tests_properties(cli_info_portable_decode_tuning PROPERTIES
                     ENVIRONMENT "TOKENMIX_ISA=portable;TOKENMIX_FP8_WIDEN=direct;TOKENMIX_LINEAR_PREFETCH=all")
tokenmix_cli_test(info_linear_prefetch_all ARGS info
                  STDOUT "decode prefetch: (address order for every cache dtype on (avx2|avx512|avx512_bf16)|row by row on (portable|neon)) \\(TOKENMIX_LINEAR_PREFETCH=all\\)")
set_tests_properties(cli_info_linear_prefetch_all PROPERTIES ENVIRONMENT "TOKENMIX_LINEAR_PREFETCH=all")
tokenmix_cli_test(info_bad_linear_prefetch ARGS info EXPECT_RC 2 ONE_LINE_ERROR
                  STDOUT_NOT "tokenmix [0-9]"
                  STDERR "TOKENMIX_LINEAR_PREFETCH must be one of all, per-dtype.*got 'rows'")
set_tests_properties(cli_info_bad_linear_prefetch PROPERTIES ENVIRONMENT "TOKENMIX_LINEAR_PREFETCH=rows")
# TOKENMIX_DECODE_AMX: `off` is shown as such on every CPU; a bad value, and `on` under a CPU cap
# that hides AMX, are one line on stderr and exit 2, before any output.
tokenmix_cli_test(info_decode_amx_off ARGS info
                  STDOUT "int8 decode:     FMA products \\(K per channel per tile: no AMX tile products\\) on [a-z0-9_]+ \\(TOKENMIX_DECODE_AMX=off\\).*fp8 decode:      FMA products \\(K per channel per tile: no AMX tile products\\) on [a-z0-9_]+ \\(TOKENMIX_DECODE_AMX=off\\).*bf16 decode:     FMA products \\(no AMX-BF16 tile products\\) on [a-z0-9_]+ \\(TOKENMIX_DECODE_AMX=off\\)")
set_tests_properties(cli_info_decode_amx_off PROPERTIES ENVIRONMENT "TOKENMIX_DECODE_AMX=off")
tokenmix_cli_test(info_bad_decode_amx ARGS info EXPECT_RC 2 ONE_LINE_ERROR
                  STDOUT_NOT "tokenmix [0-9]"
                  STDERR "TOKENMIX_DECODE_AMX must be one of on, off.*got 'sometimes'")
set_tests_properties(cli_info_bad_decode_amx PROPERTIES ENVIRONMENT "TOKENMIX_DECODE_AMX=sometimes")
tokenmix_cli_test(info_decode_amx_on_hidden ARGS info EXPECT_RC 2 ONE_LINE_ERROR
                  STDOUT_NOT "tokenmix [0-9]"
                  STDERR "TOKENMIX_DECODE_AMX=on, but this call runs the portable path, whose decode kernels have no AMX tile products")
set_tests_properties(cli_info_decode_amx_on_hidden PROPERTIES
                     ENVIRONMENT "TOKENMIX_DECODE_AMX=on;TOKENMIX_CPU_CAP=portable")
tokenmix_cli_test(check ARGS check STDOUT "PASS .*PASS .*[0-9]+ of [0-9]+ checks passed"
                  STDOUT_NOT "FAIL" TIMEOUT 600)
tokenmix_cli_test(run_small ARGS run --seq 64 --seed 7
                  STDOUT "forward +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+.*backward +[0-9.]+.*check +[0-9.]+.*dU, all heads.*dW_Q, 8 rows.*max +[0-9.e+-]+ +\\(bound [0-9.e+-]+: PASS\\).*GQA \\(H_kv = 8\\) +8192 B +4096 B.*MHA \\(H_kv = 32\\) +32768 B +16384 B"
                  STDERR "tokenmix: forward.*tokenmix: backward.*tokenmix: check" TIMEOUT 600)

# The step's roofline (fp32 cache, B = 1, T = 32, 4 steps): weights 4*4096*(4096 + 2*1024) +
# 4*4096*4096 B = 167.8 MB, K/V of 33 … 36 positions at 2*8*128*4 B = 0.3 MB per step on average.
tokenmix_cli_test(run_small_step_roofline ARGS run --seq 32 --seed 7 --decode-steps 4 --cache-dtype f32
                  STDOUT "step roofline: [0-9.]+ ms measured, reads 168\\.1 MB \\(weights 167\\.8 MB \\+ KV cache 0\\.3 MB\\), streaming read [0-9.]+ GB/s -> roofline [0-9.]+ ms, ratio [0-9.]+.*median of 4 passes.+over 256 MiB on [1-9][0-9]* threads.*decode: 4 steps on a f32 cache vs forward +[0-9.e+-]+ +\\(bound [0-9.e+-]+: PASS\\)"
                  TIMEOUT 600)

# The decode phase on quantized caches: the error against the unquantized computation, reported
# and bounded; the cache table counts one byte per element plus each row's fp32 scale.
foreach(_dt int8 fp8_e4m3)
  tokenmix_cli_test(run_small_cache_${_dt} ARGS run --seq 32 --seed 7 --decode-steps 4 --cache-dtype ${_dt}
                    STDOUT "decode: 4 steps on a ${_dt} cache vs forward \\(unquantized\\) +[0-9.e+-]+ +\\(bound [0-9.e+-]+: PASS\\).*GQA \\(H_kv = 8\\) +8192 B +4096 B +2144 B.*decode-phase cache: ${_dt}"
                    TIMEOUT 600)
endforeach()

# --- .npy mode ---------------------------------------------------------------------------------
# Inputs: set a (B=2, T=33, H_q=4, H_kv=2, d_h=16), set b (B=1, T_q=5, T_k=12, H_q=4, H_kv=1,
# d_h=8), and malformed files. Built once by fixture tests.
set(_cli_a ${TOKENMIX_CLI_DIR}/a)
set(_cli_b ${TOKENMIX_CLI_DIR}/b)
set(_cli_bad ${TOKENMIX_CLI_DIR}/bad)
file(MAKE_DIRECTORY ${_cli_a} ${_cli_b} ${_cli_bad})
add_test(NAME cli_npy_setup_a COMMAND tokenmix_cli_npy_tool make ${_cli_a} 2 33 33 4 2 16 11)
add_test(NAME cli_npy_setup_b COMMAND tokenmix_cli_npy_tool make ${_cli_b} 1 5 12 4 1 8 12)
add_test(NAME cli_npy_setup_bad COMMAND tokenmix_cli_npy_tool malformed ${_cli_bad})
set_tests_properties(cli_npy_setup_a cli_npy_setup_b cli_npy_setup_bad
                     PROPERTIES FIXTURES_SETUP cli_npy LABELS cli)

set(_cli_qkv_a --q ${_cli_a}/q.npy --k ${_cli_a}/k.npy --v ${_cli_a}/v.npy)
set(_cli_qkv_b --q ${_cli_b}/q.npy --k ${_cli_b}/k.npy --v ${_cli_b}/v.npy)
tokenmix_cli_test(npy_forward FIXTURES cli_npy
                  ARGS run ${_cli_qkv_a} --out ${_cli_a}/fo.npy --lse ${_cli_a}/flse.npy
                  STDOUT "wrote --out .*\\[2, 33, 4, 16\\].*wrote --lse .*\\[2, 4, 33\\]"
                  CLEAN ${_cli_a}/fo.npy ${_cli_a}/flse.npy
                  POST ${TOKENMIX_CLI_NPY_TOOL} verify ${_cli_a} f)
tokenmix_cli_test(npy_backward FIXTURES cli_npy
                  ARGS run ${_cli_qkv_a} --out ${_cli_a}/go.npy --lse ${_cli_a}/glse.npy --dout ${_cli_a}/do.npy
                       --dq ${_cli_a}/gdq.npy --dk ${_cli_a}/gdk.npy --dv ${_cli_a}/gdv.npy --threads 1
                  STDOUT "backward: .*wrote --dv"
                  POST ${TOKENMIX_CLI_NPY_TOOL} verify ${_cli_a} g --grad
                  CLEAN ${_cli_a}/go.npy ${_cli_a}/glse.npy ${_cli_a}/gdq.npy ${_cli_a}/gdk.npy
                        ${_cli_a}/gdv.npy)
tokenmix_cli_test(npy_float64_input FIXTURES cli_npy
                  ARGS run --q ${_cli_a}/q64.npy --k ${_cli_a}/k.npy --v ${_cli_a}/v.npy --out ${_cli_a}/ho.npy
                       --lse ${_cli_a}/hlse.npy
                  POST ${TOKENMIX_CLI_NPY_TOOL} verify ${_cli_a} h
                  CLEAN ${_cli_a}/ho.npy ${_cli_a}/hlse.npy)
tokenmix_cli_test(npy_no_causal_scale FIXTURES cli_npy
                  ARGS run ${_cli_qkv_a} --out ${_cli_a}/no.npy --lse ${_cli_a}/nlse.npy --no-causal
                       --scale 0.2 --isa portable
                  STDOUT "no mask"
                  POST ${TOKENMIX_CLI_NPY_TOOL} verify ${_cli_a} n --no-causal --scale 0.2
                  CLEAN ${_cli_a}/no.npy ${_cli_a}/nlse.npy)
tokenmix_cli_test(npy_bottom_right FIXTURES cli_npy
                  ARGS run ${_cli_qkv_b} --out ${_cli_b}/bo.npy --lse ${_cli_b}/blse.npy --dout ${_cli_b}/do.npy
                       --dq ${_cli_b}/bdq.npy --dk ${_cli_b}/bdk.npy --dv ${_cli_b}/bdv.npy
                  STDOUT "T_q=5 T_k=12.*bottom_right"
                  POST ${TOKENMIX_CLI_NPY_TOOL} verify ${_cli_b} b --grad
                  CLEAN ${_cli_b}/bo.npy ${_cli_b}/blse.npy ${_cli_b}/bdq.npy ${_cli_b}/bdk.npy
                        ${_cli_b}/bdv.npy)
tokenmix_cli_test(npy_top_left FIXTURES cli_npy
                  ARGS run ${_cli_qkv_b} --out ${_cli_b}/to.npy --lse ${_cli_b}/tlse.npy --dout ${_cli_b}/do.npy
                       --dq ${_cli_b}/tdq.npy --dk ${_cli_b}/tdk.npy --dv ${_cli_b}/tdv.npy --align top_left
                  STDOUT "top_left"
                  POST ${TOKENMIX_CLI_NPY_TOOL} verify ${_cli_b} t --grad --top-left
                  CLEAN ${_cli_b}/to.npy ${_cli_b}/tlse.npy ${_cli_b}/tdq.npy ${_cli_b}/tdk.npy
                        ${_cli_b}/tdv.npy)
# Score variants (SPEC "Score variants used by real models"), forward and backward with d(sinks),
# against the oracle: every variant at once on set b (T_q < T_k, bottom-right and top-left), the
# window alone with one sink value for every head on set a, on the default kernel path.
tokenmix_cli_test(npy_variants FIXTURES cli_npy
                  ARGS run ${_cli_qkv_b} --out ${_cli_b}/vo.npy --lse ${_cli_b}/vlse.npy --dout ${_cli_b}/do.npy
                       --dq ${_cli_b}/vdq.npy --dk ${_cli_b}/vdk.npy --dv ${_cli_b}/vdv.npy
                       --dsinks ${_cli_b}/vdsinks.npy --window 4 --softcap 3 --alibi --sinks 0.5,-1,0,1.5
                  STDOUT "bottom_right, window=4 softcap=3 alibi sinks=0.5,-1,0,1.5, kernel path.*wrote --dsinks .*\\[4\\]"
                  POST ${TOKENMIX_CLI_NPY_TOOL} verify ${_cli_b} v --grad --window 4 --softcap 3 --alibi
                       --sinks 0.5,-1,0,1.5
                  CLEAN ${_cli_b}/vo.npy ${_cli_b}/vlse.npy ${_cli_b}/vdq.npy ${_cli_b}/vdk.npy
                        ${_cli_b}/vdv.npy ${_cli_b}/vdsinks.npy)
tokenmix_cli_test(npy_variants_top_left_portable FIXTURES cli_npy
                  ARGS run ${_cli_qkv_b} --out ${_cli_b}/uo.npy --lse ${_cli_b}/ulse.npy --dout ${_cli_b}/do.npy
                       --dq ${_cli_b}/udq.npy --dk ${_cli_b}/udk.npy --dv ${_cli_b}/udv.npy
                       --dsinks ${_cli_b}/udsinks.npy --align top_left --window 2 --alibi --sinks -0.5
                       --isa portable
                  STDOUT "top_left, window=2 alibi sinks=-0.5, kernel path portable"
                  POST ${TOKENMIX_CLI_NPY_TOOL} verify ${_cli_b} u --grad --top-left --window 2 --alibi
                       --sinks -0.5
                  CLEAN ${_cli_b}/uo.npy ${_cli_b}/ulse.npy ${_cli_b}/udq.npy ${_cli_b}/udk.npy
                        ${_cli_b}/udv.npy ${_cli_b}/udsinks.npy)
tokenmix_cli_test(npy_window_softcap FIXTURES cli_npy
                  ARGS run ${_cli_qkv_a} --out ${_cli_a}/xo.npy --lse ${_cli_a}/xlse.npy --window 7 --softcap 2.5
                  STDOUT "window=7 softcap=2.5"
                  POST ${TOKENMIX_CLI_NPY_TOOL} verify ${_cli_a} x --window 7 --softcap 2.5
                  CLEAN ${_cli_a}/xo.npy ${_cli_a}/xlse.npy)
# Attention dropout (docs/design.md D.1–D.4), forward and backward against the oracle given the
# library's mask for the seed; a --dropout outside [0, 1) is one line on stderr and exit 2, and
# decode refuses it.
tokenmix_cli_test(npy_dropout FIXTURES cli_npy
                  ARGS run ${_cli_qkv_b} --out ${_cli_b}/ro.npy --lse ${_cli_b}/rlse.npy --dout ${_cli_b}/do.npy
                       --dq ${_cli_b}/rdq.npy --dk ${_cli_b}/rdk.npy --dv ${_cli_b}/rdv.npy
                       --dsinks ${_cli_b}/rdsinks.npy --dropout 0.3 --dropout-seed 77 --sinks 0.5
                  STDOUT "sinks=0.5 dropout=0.3, kernel path"
                  POST ${TOKENMIX_CLI_NPY_TOOL} verify ${_cli_b} r --grad --sinks 0.5 --dropout 0.3
                       --dropout-seed 77
                  CLEAN ${_cli_b}/ro.npy ${_cli_b}/rlse.npy ${_cli_b}/rdq.npy ${_cli_b}/rdk.npy
                        ${_cli_b}/rdv.npy ${_cli_b}/rdsinks.npy)
tokenmix_cli_test(npy_dropout_out_of_range FIXTURES cli_npy
                  ARGS run ${_cli_qkv_b} --out ${_cli_b}/ro2.npy --dropout 1.5
                  EXPECT_RC 2 ONE_LINE_ERROR STDERR "--dropout must be in .0, 1.*got 1[.]5")
tokenmix_cli_test(bench_decode_refuses_dropout
                  ARGS bench decode --gemm-n 128 --read-mib 16 --cache-tokens 256 --hq 4 --hkv 2 --dh 16
                       --repeats 1 --dropout 0.1
                  EXPECT_RC 2 ONE_LINE_ERROR STDERR "decode.*--dropout.*has no dropout")
# The bench records the variants in its JSON (one tiny case; not a timing test).
tokenmix_cli_test(bench_variants_json
                  ARGS bench forward --gemm-n 128 --tq 64 --hq 4 --hkv 2 --dh 16 --repeats 1 --json --window 16
                       --softcap 30 --alibi --sinks 0.25 TIMEOUT 600
                  STDOUT "\"op\": \"forward\".*\"window\": 16, \"softcap\": 30, \"alibi\": true, \"sinks\": \\[0.25\\]")
tokenmix_cli_test(bench_decode_variants_json
                  ARGS bench decode --gemm-n 128 --read-mib 16 --cache-tokens 256 --cache-dtype f32 --hq 4 --hkv 2 --dh 16 --repeats 1
                       --json --window 64 --sinks 0,1,2,3 TIMEOUT 600
                  STDOUT "\"op\": \"decode\".*\"ceiling_kind\": \"openblas_sgemm_128\", \"sgemm_core\": \"[A-Za-z0-9_]+\".*\"window\": 64, \"softcap\": null, \"alibi\": false, \"sinks\": \\[0, 1, 2, 3\\].*\"ceiling_gbps_kind\": \"stream_read_16MiB\"")
# forward / backward: the sgemm ceiling's passes, interleaved with the timed calls, and their
# spread (issue 58: one slow ceiling pass decides no ratio).
tokenmix_cli_test(bench_ceiling_spread_json
                  ARGS bench backward --gemm-n 128 --tq 64 --hq 4 --hkv 2 --dh 16 --repeats 3 --json TIMEOUT 600
                  STDOUT "\"op\": \"backward\".*\"ceiling_gflops\": [0-9.e+-]+.*\"ceiling_min\": [0-9.e+-]+, \"ceiling_max\": [0-9.e+-]+")
# bf16 on a CPU without bf16 GEMM instructions (TOKENMIX_CPU_CAP=avx2: as on AMD Zen 3, where
# oneDNN has no bf16 matmul): the ceiling is sgemm over the widened operands, and says so.
tokenmix_cli_test(bench_bf16_ceiling_without_bf16_gemm
                  ARGS bench forward --gemm-n 128 --tq 64 --hq 4 --hkv 2 --dh 16 --repeats 1 --json --dtype bf16
                       TIMEOUT 600
                  STDOUT "\"op\": \"forward\".*\"dtype\": \"bf16\", \"ceiling_kind\": \"openblas_sgemm_128 \\(no bf16 GEMM instructions on this CPU")
set_tests_properties(cli_bench_bf16_ceiling_without_bf16_gemm PROPERTIES ENVIRONMENT "TOKENMIX_CPU_CAP=avx2")
# Quantized caches (int8, fp8 E4M3): the same decode keys plus tokens_per_s; bytes count scales.
tokenmix_cli_test(bench_decode_quantized_json
                  ARGS bench decode --gemm-n 128 --read-mib 16 --cache-tokens 256 --cache-dtype int8,fp8_e4m3 --hq 4 --hkv 2
                       --dh 16 --repeats 1 --json TIMEOUT 600
                  STDOUT "\"cache_dtype\": \"int8\", \"gbps\": [0-9.e+-]+, \"ceiling_gbps\": [0-9.e+-]+, \"tokens_per_s\": [0-9.e+-]+, \"err_vs_unquantized\": [0-9.e+-]+, \"kv_outlier\": 1.*\"cache_dtype\": \"fp8_e4m3\"")
tokenmix_cli_test(bench_decode_outlier_json
                  ARGS bench decode --gemm-n 128 --read-mib 16 --cache-tokens 128 --cache-dtype int8 --hq 2 --hkv 1 --dh 16
                       --repeats 1 --json --kv-outlier 30 TIMEOUT 600
                  STDOUT "\"cache_dtype\": \"int8\".*\"kv_outlier\": 30")
# The real-keys profile (testkit::apply_real_keys; docs/performance.md, D-kv-4).
tokenmix_cli_test(bench_decode_real_keys_json
                  ARGS bench decode --gemm-n 128 --read-mib 16 --cache-tokens 130 --cache-dtype bf16,int8 --hq 4 --hkv 2
                       --dh 16 --repeats 1 --json --kv-profile real TIMEOUT 600
                  STDOUT "\"cache_dtype\": \"bf16\".*\"kv_profile\": \"real\".*\"cache_dtype\": \"int8\".*\"kv_profile\": \"real\"")
tokenmix_cli_test(bench_plain_json_has_no_variants
                  ARGS bench backward --gemm-n 128 --tq 32 --hq 2 --hkv 1 --dh 8 --repeats 1 --json TIMEOUT 600
                  STDOUT "\"window\": null, \"softcap\": null, \"alibi\": false, \"sinks\": null")
# Issue 16: decode measures both ceilings (streaming read and forward's sgemm) and reports the
# roofline time max(bytes / read ceiling, FLOPs / sgemm ceiling) and ratio_roofline; --batch and
# --tnew are lists (one case each); --lengths mixed draws per-sequence lengths deterministically.
# bench_json_check recomputes the new keys from each JSON line's own fields (not a timing test).
function(tokenmix_bench_json_test name)
  add_test(NAME cli_${name} COMMAND tokenmix_cli_bench_json_check $<TARGET_FILE:tokenmix_cli>
                                    ${ARGN})
  set_tests_properties(cli_${name} PROPERTIES TIMEOUT 600 LABELS cli)
endfunction()
tokenmix_bench_json_test(bench_decode_roofline_lists
                         --lines 8 --values batch=1,3 --values tq=1,2 --values tk=64,80
                         --lengths equal
                         -- bench decode --gemm-n 128 --read-mib 16 --batch 1,3 --tnew 1,2 --cache-tokens 64,80
                            --cache-dtype f32 --hq 4 --hkv 2 --dh 16 --threads 1 --repeats 1 --json)
tokenmix_bench_json_test(bench_decode_mixed_lengths
                         --lines 3 --runs 2 --lengths mixed --values cache_dtype=f32,bf16,int8
                         -- bench decode --gemm-n 128 --read-mib 16 --batch 4 --cache-tokens 64 --cache-dtype f32,bf16,int8
                            --lengths mixed --hq 4 --hkv 2 --dh 16 --threads 1 --repeats 1 --json)
tokenmix_bench_json_test(bench_decode_roofline_window
                         --lines 1 --lengths mixed
                         -- bench decode --gemm-n 128 --read-mib 16 --batch 3 --tnew 2 --cache-tokens 100 --cache-dtype f16
                            --lengths mixed --window 16 --hq 4 --hkv 2 --dh 16 --threads 1
                            --repeats 1 --json)
# --rounds N: the case list visited N times round-robin (a slow phase of a shared machine takes
# part of every case's samples); one line per case, after the last round, with "rounds": N.
tokenmix_bench_json_test(bench_decode_rounds
                         --lines 2 --values rounds=2 --values cache_dtype=f32,int8
                         -- bench decode --gemm-n 128 --read-mib 16 --cache-tokens 64 --cache-dtype f32,int8 --rounds 2
                            --hq 4 --hkv 2 --dh 16 --threads 1 --repeats 1 --json)
tokenmix_cli_test(bench_decode_rounds_progress
                  ARGS bench decode --gemm-n 128 --read-mib 16 --cache-tokens 64 --cache-dtype f32,bf16 --rounds 2 --hq 4
                       --hkv 2 --dh 16 --threads 1 --repeats 1 TIMEOUT 600
                  STDERR "cache=f32 .*round 1/2.*cache=bf16 .*round 1/2.*cache=f32 .*round 2/2.*cache=bf16 .*round 2/2")
tokenmix_bench_json_test(bench_forward_batch_list
                         --lines 2 --values batch=1,2 --values op=forward
                         -- bench forward --gemm-n 128 --batch 1,2 --tq 32 --hq 2 --hkv 1 --dh 8 --threads 1
                            --repeats 1 --json)
# The draw of --lengths mixed is fixed (std::mt19937_64, seed 16): B = 4, T_k = 64 holds
# 312 positions in all, from 58 to 93 (not 4 · 64); the table shows the new columns.
tokenmix_cli_test(bench_decode_mixed_table
                  ARGS bench decode --gemm-n 128 --read-mib 16 --batch 4 --cache-tokens 64 --cache-dtype f32 --lengths mixed
                       --hq 4 --hkv 2 --dh 16 --threads 1 --repeats 1 TIMEOUT 600
                  STDOUT "sgemm ceiling: OpenBLAS [A-Za-z0-9_]+ kernel.*lengths: mixed.*seed 16.*B T_new +T_k +sum_T_k.*GB/s ceiling +ratio +GFLOP/s +sgemm +roof_ms +r_roof.*decode +4 +1 +64 +312 ")
tokenmix_cli_test(bench_decode_mixed_json_total
                  ARGS bench decode --gemm-n 128 --read-mib 16 --batch 4 --cache-tokens 64 --cache-dtype f32 --lengths mixed
                       --hq 4 --hkv 2 --dh 16 --threads 1 --repeats 1 --json TIMEOUT 600
                  STDOUT "\"lengths\": \"mixed\", \"cache_tokens_total\": 312, \"cache_tokens_min\": 58, \"cache_tokens_max\": 93")
tokenmix_cli_test(bench_help_decode_lists ARGS bench --help
                  STDOUT "--batch.*comma-separated.*--tnew.*comma-separated.*--lengths.*mixed.*seed 16")

# A successful run replaces an existing output, through a temporary file that does not remain.
# (Only this run's temporaries: other tests write their own outputs into the same directory
# at the same time under ctest -j.)
tokenmix_cli_test(npy_replaces_existing_output FIXTURES cli_npy
                  ARGS run ${_cli_qkv_a} --out ${_cli_a}/wo.npy --lse ${_cli_a}/wlse.npy
                  COPY ${_cli_a}/do.npy ${_cli_a}/wo.npy
                  POST ${TOKENMIX_CLI_NPY_TOOL} verify ${_cli_a} w
                  NO_GLOB ${_cli_a}/.wo.npy.tokenmix-* ${_cli_a}/.wlse.npy.tokenmix-*
                  CLEAN ${_cli_a}/wlse.npy)

# --- errors: exit 2, exactly one stderr line, nothing written -----------------------------------
set(_cli_e ${_cli_a}/err_o.npy)
set(_cli_else ${_cli_a}/err_lse.npy)
set(_cli_egrad ${_cli_a}/edq.npy ${_cli_a}/edk.npy ${_cli_a}/edv.npy)
function(tokenmix_cli_error name stderr_re)
  tokenmix_cli_test(${name} FIXTURES cli_npy EXPECT_RC 2 ONE_LINE_ERROR STDERR "${stderr_re}"
                    NOT_EXIST ${_cli_e} ${_cli_else} ${_cli_egrad} ${ARGN})
endfunction()
tokenmix_cli_error(error_missing_file "cannot open.*No such file"
                   ARGS run --q ${_cli_a}/missing.npy --k ${_cli_a}/k.npy --v ${_cli_a}/v.npy --out ${_cli_e})
tokenmix_cli_error(error_bad_magic "bad_magic.npy.*bad magic"
                   ARGS run --q ${_cli_bad}/bad_magic.npy --k ${_cli_a}/k.npy --v ${_cli_a}/v.npy --out ${_cli_e})
tokenmix_cli_error(error_truncated "truncated.npy.*truncated data"
                   ARGS run ${_cli_qkv_a} --out ${_cli_e} --dout ${_cli_bad}/truncated.npy --dq ${_cli_a}/edq.npy
                        --dk ${_cli_a}/edk.npy --dv ${_cli_a}/edv.npy)
tokenmix_cli_error(error_dtype "int32.npy.*unsupported dtype '<i4'"
                   ARGS run --q ${_cli_bad}/int32.npy --k ${_cli_a}/k.npy --v ${_cli_a}/v.npy --out ${_cli_e})
tokenmix_cli_error(error_rank "rank3.npy.*expected rank 4"
                   ARGS run --q ${_cli_a}/q.npy --k ${_cli_bad}/rank3.npy --v ${_cli_a}/v.npy --out ${_cli_e})
tokenmix_cli_error(error_shape_mismatch "--k .*must match --q"
                   ARGS run --q ${_cli_a}/q.npy --k ${_cli_b}/k.npy --v ${_cli_b}/v.npy --out ${_cli_e}
                        --lse ${_cli_else})
tokenmix_cli_error(error_v_shape "--v .*must have the shape of --k"
                   ARGS run --q ${_cli_a}/q.npy --k ${_cli_a}/k.npy --v ${_cli_b}/v.npy --out ${_cli_e})
tokenmix_cli_error(error_dout_shape "--dout .*must have the shape of --q"
                   ARGS run ${_cli_qkv_a} --out ${_cli_e} --dout ${_cli_b}/do.npy --dq ${_cli_a}/edq.npy
                        --dk ${_cli_a}/edk.npy --dv ${_cli_a}/edv.npy)
tokenmix_cli_error(error_dout_without_dq "needs all of --dout, --dq, --dk and --dv.*missing --dq, --dk, --dv"
                   ARGS run ${_cli_qkv_a} --out ${_cli_e} --dout ${_cli_a}/do.npy)
tokenmix_cli_error(error_dq_without_dout "missing --dout"
                   ARGS run ${_cli_qkv_a} --out ${_cli_e} --dq ${_cli_a}/edq.npy --dk ${_cli_a}/edk.npy
                        --dv ${_cli_a}/edv.npy)
tokenmix_cli_error(error_bad_align "--align must be one of bottom_right, top_left; got 'middle'"
                   ARGS run ${_cli_qkv_a} --out ${_cli_e} --align middle)
# One spelling (Python's): the hyphenated form is not accepted.
tokenmix_cli_error(error_align_hyphen "--align must be one of bottom_right, top_left; got 'top-left'"
                   ARGS run ${_cli_qkv_a} --out ${_cli_e} --align top-left)
tokenmix_cli_error(error_missing_out "missing --out" ARGS run ${_cli_qkv_a} --lse ${_cli_else})
tokenmix_cli_error(error_same_output "--out and --lse name the same file"
                   ARGS run ${_cli_qkv_a} --out ${_cli_e} --lse ${_cli_e})
tokenmix_cli_error(error_write_fails_cleans_up "cannot create"
                   ARGS run ${_cli_qkv_a} --out ${_cli_e} --lse ${TOKENMIX_CLI_DIR}/no_such_dir/lse.npy
                   NO_GLOB ${_cli_a}/.err_o.npy.tokenmix-*)

# --- files the user already has survive every failure ----------------------------------------
# (NO_GLOB patterns name each test's own outputs: other tests write theirs into the same
# directories at the same time under ctest -j.)
# A pre-existing output is left as it was when a later output cannot be written (no temporary
# file is left behind either).
# Each test has its own pre-existing output: under ctest -j a shared one is rewritten by one
# test's COPY while another hashes it.
tokenmix_cli_error(error_failed_run_keeps_existing_output "--lse .*cannot create"
                   ARGS run ${_cli_qkv_a} --out ${_cli_a}/prev_run.npy
                        --lse ${TOKENMIX_CLI_DIR}/no_such_dir/lse_run.npy
                   COPY ${_cli_a}/do.npy ${_cli_a}/prev_run.npy UNCHANGED ${_cli_a}/prev_run.npy
                   NO_GLOB ${_cli_a}/.prev_run.npy.tokenmix-* ${TOKENMIX_CLI_DIR}/.lse_run.npy.tokenmix-*)
tokenmix_cli_error(error_failed_input_keeps_existing_output "missing.npy.*No such file"
                   ARGS run --q ${_cli_a}/missing.npy --k ${_cli_a}/k.npy --v ${_cli_a}/v.npy
                        --out ${_cli_a}/prev_input.npy
                   COPY ${_cli_a}/do.npy ${_cli_a}/prev_input.npy UNCHANGED ${_cli_a}/prev_input.npy
                   NO_GLOB ${_cli_a}/.prev_input.npy.tokenmix-*)
# An output that is a directory is refused before anything is written (so --out, renamed
# first, is not replaced either).
tokenmix_cli_error(error_output_is_directory "--lse .*is a directory"
                   ARGS run ${_cli_qkv_a} --out ${_cli_a}/prev_dir.npy --lse ${_cli_b}
                   COPY ${_cli_a}/do.npy ${_cli_a}/prev_dir.npy UNCHANGED ${_cli_a}/prev_dir.npy
                   NO_GLOB ${_cli_a}/.prev_dir.npy.tokenmix-*)
# An output naming an input is refused (exit 2) and the input is untouched: spelled the same,
# through ./ and through sub/../, and as the --dout of a backward run.
file(MAKE_DIRECTORY ${_cli_a}/sub)
tokenmix_cli_error(error_out_is_q "--out .*names the input file of --q"
                   ARGS run ${_cli_qkv_a} --out ${_cli_a}/q.npy UNCHANGED ${_cli_a}/q.npy)
tokenmix_cli_error(error_lse_is_v_dot "--lse .*names the input file of --v"
                   ARGS run ${_cli_qkv_a} --out ${_cli_e} --lse ${_cli_a}/./v.npy
                   UNCHANGED ${_cli_a}/v.npy)
tokenmix_cli_error(error_dq_is_dout_dotdot "--dq .*names the input file of --dout"
                   ARGS run ${_cli_qkv_a} --out ${_cli_e} --dout ${_cli_a}/do.npy
                        --dq ${_cli_a}/sub/../do.npy --dk ${_cli_a}/edk.npy --dv ${_cli_a}/edv.npy
                   UNCHANGED ${_cli_a}/do.npy)
tokenmix_cli_error(error_out_is_k_relative "--out 'k.npy' names the input file of --k"
                   ARGS run ${_cli_qkv_a} --out k.npy WORKDIR ${_cli_a} UNCHANGED ${_cli_a}/k.npy)
# Two outputs naming one file that does not exist yet (relative, through ./ and sub/../).
tokenmix_cli_error(error_same_output_dot "--out and --lse name the same file \\('err_o.npy' and './err_o.npy'\\)"
                   ARGS run ${_cli_qkv_a} --out err_o.npy --lse ./err_o.npy WORKDIR ${_cli_a})
tokenmix_cli_error(error_same_output_dotdot "--out and --dk name the same file \\('err_o.npy' and 'sub/\\.\\./err_o.npy'\\)"
                   ARGS run ${_cli_qkv_a} --out err_o.npy --dout do.npy --dq edq.npy --dk sub/../err_o.npy
                        --dv edv.npy WORKDIR ${_cli_a})
# A file with d_h = 0 and huge other sizes (no data): the size error, not "out of memory".
tokenmix_cli_error(error_dh_zero_huge "dh0_huge.npy.*d_h must be >= 1 \\(axis 3\\); got 0"
                   ARGS run --q ${_cli_bad}/dh0_huge.npy --k ${_cli_bad}/dh0_huge.npy
                        --v ${_cli_bad}/dh0_huge.npy --out ${_cli_e})
# H = 0 likewise, and an empty file (B = 0) whose T·H·d_h overflows int64.
tokenmix_cli_error(error_h_zero_huge "h0_huge.npy.*H_q must be >= 1 \\(axis 2\\); got 0"
                   ARGS run --q ${_cli_bad}/h0_huge.npy --k ${_cli_bad}/h0_huge.npy
                        --v ${_cli_bad}/h0_huge.npy --out ${_cli_e})
tokenmix_cli_error(error_empty_overflowing_sizes "b0_huge.npy.*T \\* H \\* d_h overflows 64-bit"
                   ARGS run --q ${_cli_bad}/b0_huge.npy --k ${_cli_bad}/b0_huge.npy
                        --v ${_cli_bad}/b0_huge.npy --out ${_cli_e})
tokenmix_cli_error(error_bad_scale "scale" ARGS run ${_cli_qkv_a} --out ${_cli_e} --scale nan)
tokenmix_cli_error(error_bad_isa "isa.*bogus" ARGS run --isa bogus)
if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$")
  # An x86 build has no neon kernels: forcing that path names the build, nothing is written.
  tokenmix_cli_error(error_isa_not_built "isa 'neon'.*this build has no kernels"
                     ARGS run ${_cli_qkv_a} --out ${_cli_e} --isa neon)
  tokenmix_cli_error(error_check_isa_not_built "isa 'neon'.*this build has no kernels"
                     ARGS check --isa neon)
endif()
tokenmix_cli_error(error_seq_in_file_mode "--seq applies only to the built-in layer run"
                   ARGS run ${_cli_qkv_a} --out ${_cli_e} --seq 8)
tokenmix_cli_error(error_scale_without_files "--scale applies only to file mode"
                   ARGS run --scale 0.5)
tokenmix_cli_error(error_bad_seq "--seq" ARGS run --seq 0)
tokenmix_cli_error(error_bad_cache_dtype "--cache-dtype: int4 not in"
                   ARGS run --seq 8 --cache-dtype int4)
tokenmix_cli_error(error_bench_bad_cache_dtype "--cache-dtype: fp8 not in"
                   ARGS bench decode --cache-dtype fp8)
tokenmix_cli_error(error_bench_bad_kv_outlier "--kv-outlier must be a finite number > 0; got -1"
                   ARGS bench decode --cache-tokens 64 --kv-outlier -1)
tokenmix_cli_error(error_bench_bad_kv_profile "--kv-profile: llama not in"
                   ARGS bench decode --cache-tokens 64 --kv-profile llama)
tokenmix_cli_error(error_bench_tnew_zero "bench: --tnew values must be >= 1; got 0"
                   ARGS bench decode --cache-tokens 64 --tnew 0)
tokenmix_cli_error(error_bench_tnew_list_zero "bench: --tnew values must be >= 1; got 0"
                   ARGS bench decode --cache-tokens 64 --tnew 2,0)
tokenmix_cli_error(error_bench_batch_zero "bench: --batch values must be >= 1; got 0"
                   ARGS bench decode --cache-tokens 64 --batch 0)
tokenmix_cli_error(error_bench_batch_list_zero "bench: --batch values must be >= 1; got 0"
                   ARGS bench forward --tq 16 --batch 1,0)
tokenmix_cli_error(error_bench_bad_lengths "--lengths: foo not in"
                   ARGS bench decode --cache-tokens 64 --lengths foo)
tokenmix_cli_error(error_bench_mixed_lengths_forward "--lengths mixed applies only to decode.*got op forward"
                   ARGS bench forward --tq 16 --lengths mixed)
tokenmix_cli_error(error_bench_rounds_zero "bench: --rounds must be >= 1; got 0"
                   ARGS bench decode --cache-tokens 64 --rounds 0)
tokenmix_cli_error(error_bench_rounds_forward "--rounds applies only to decode.*got op forward with --rounds 2"
                   ARGS bench forward --tq 16 --rounds 2)
tokenmix_cli_error(error_bench_cache_tokens_zero "bench: --cache-tokens values must be >= 1; got 0"
                   ARGS bench decode --cache-tokens 0)
# The ceilings' sizes (--gemm-n, --read-mib): out of range, or --read-mib for an op without a
# streaming-read ceiling, before any work.
tokenmix_cli_error(error_bench_gemm_n_small "the sgemm ceiling's size n must be in \\[16, 16384\\]; got 8"
                   ARGS bench forward --tq 16 --gemm-n 8)
tokenmix_cli_error(error_bench_read_mib_zero "bench: --read-mib must be in \\[1, 1048576\\]; got 0"
                   ARGS bench decode --cache-tokens 64 --read-mib 0)
tokenmix_cli_error(error_bench_read_mib_forward "--read-mib applies only to decode.*got op forward"
                   ARGS bench forward --tq 16 --read-mib 16)
# Score-variant flags: bad values, sinks of the wrong length, file mode only, --dsinks needs them.
tokenmix_cli_error(error_window_zero "--window: Value 0 not in range"
                   ARGS run ${_cli_qkv_a} --out ${_cli_e} --window 0)
tokenmix_cli_error(error_window_not_int "--window"
                   ARGS run ${_cli_qkv_a} --out ${_cli_e} --window 2.5)
tokenmix_cli_error(error_softcap_negative "--softcap must be a finite number > 0; got -1"
                   ARGS run ${_cli_qkv_a} --out ${_cli_e} --softcap -1)
tokenmix_cli_error(error_softcap_inf "--softcap must be a finite number > 0; got inf"
                   ARGS run ${_cli_qkv_a} --out ${_cli_e} --softcap inf)
tokenmix_cli_error(error_sinks_count "--sinks has 3 values; expected 1 \\(every head\\) or H_q = 4"
                   ARGS run ${_cli_qkv_a} --out ${_cli_e} --sinks 1,2,3)
tokenmix_cli_error(error_sinks_nan "--sinks values must be finite; got nan"
                   ARGS run ${_cli_qkv_a} --out ${_cli_e} --sinks nan)
tokenmix_cli_error(error_dsinks_without_sinks "--dsinks .*needs --sinks"
                   ARGS run ${_cli_qkv_a} --out ${_cli_e} --dout ${_cli_a}/do.npy --dq ${_cli_a}/edq.npy
                        --dk ${_cli_a}/edk.npy --dv ${_cli_a}/edv.npy --dsinks ${_cli_a}/eds.npy
                   NOT_EXIST ${_cli_a}/eds.npy)
tokenmix_cli_error(error_variants_in_layer_mode "--window, --alibi: the score variants apply only to file mode"
                   ARGS run --window 8 --alibi)
tokenmix_cli_error(error_bench_sinks_count "--sinks has 2 values; expected 1 \\(every head\\) or H_q = 4"
                   ARGS bench forward --tq 16 --hq 4 --hkv 2 --dh 8 --repeats 1 --sinks 1,2)
tokenmix_cli_error(error_bench_softcap_zero "--softcap must be a finite number > 0; got 0"
                   ARGS bench decode --softcap 0)
tokenmix_cli_error(error_bench_window_negative "--window"
                   ARGS bench backward --window -4)
tokenmix_cli_error(error_unknown_option "--bogus" ARGS run --bogus)
tokenmix_cli_error(error_no_command "subcommand" ARGS)
tokenmix_cli_error(error_unknown_command "unknown command 'frobnicate'" ARGS frobnicate)

# --- bench --dtype (issue 13): a bad dtype is one error line, exit 2, before any measurement ----
tokenmix_cli_test(bench_bad_dtype ARGS bench forward --dtype f8 --tq 8 --repeats 1
                  EXPECT_RC 2 ONE_LINE_ERROR STDERR "--dtype: f8 not in")
