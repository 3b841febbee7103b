# segxfer: one entry point.
#
#   make deps      install the Debian packages that are missing (apt-get)
#   make           build libsegxfer.a, libsegxfer.so and the programs
#   make test      deps + build + every test (unit, integration, end-to-end, RDMA)
#   make test-python  deps + build + the Python package's tests (tests/python/)
#   make run       deps + build + a live demo on a local redis-server
#   make cluster   deps + build + the multi-host demo on network namespaces (root)
#   make bench     build + the representative benchmarks (about 5 minutes) into
#                  $(BUILD)/bench/: tables, CSV, plots
#   make install   PREFIX=/usr/local DESTDIR= (headers, libraries, segxfer.pc, programs,
#                  manual pages); make uninstall removes exactly those files
#
# SANITIZE=address,undefined builds into its own directory (build-address-undefined)
# and runs the same tests.  Every build is out of tree, under $(BUILD).

VERSION   := 0.1.0
SOVERSION := 0
PREFIX    ?= /usr/local
LIBDIR    ?= $(PREFIX)/lib
INCDIR    ?= $(PREFIX)/include
BINDIR    ?= $(PREFIX)/bin
MANDIR    ?= $(PREFIX)/share/man
DESTDIR   ?=

comma := ,
SANITIZE ?=
ifeq ($(SANITIZE),)
BUILD ?= build
else
BUILD ?= build-$(subst $(comma),-,$(SANITIZE))
endif

# ---------------------------------------------------------------- packages
# Libraries are found with pkg-config; these are the Debian packages behind them
# and behind the tests (servers, tools).
PKGS      := hiredis libuv libprotobuf-c libibverbs librdmacm jansson libcurl libmicrohttpd
TEST_PKGS := cmocka
DEB_PKGS  := build-essential pkg-config protobuf-c-compiler \
             libhiredis-dev libuv1-dev libprotobuf-c-dev libibverbs-dev librdmacm-dev \
             libjansson-dev libcurl4-openssl-dev libmicrohttpd-dev libcmocka-dev \
             redis-server redis-sentinel redis-tools etcd-server etcd-client openssl \
             ibverbs-providers ibverbs-utils rdmacm-utils perftest \
             iproute2 nftables procps psmisc gnuplot-nox clang libclang-rt-14-dev valgrind \
             curl groff-base man-db python3-yaml shellcheck stunnel4 \
             python3-torch python3-numpy python3-pytest python3-zmq python3-pydantic

# ---------------------------------------------------------------- flags
PKG_CFLAGS  = $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
PKG_LIBS    = $(shell pkg-config --libs $(PKGS) 2>/dev/null)
TEST_CFLAGS = $(shell pkg-config --cflags $(TEST_PKGS) 2>/dev/null)
TEST_LIBS   = $(shell pkg-config --libs $(TEST_PKGS) 2>/dev/null)

OPT    ?= -O2 -g
WARN   := -Wall -Wextra -Wshadow -Wstrict-prototypes -Wwrite-strings -Werror
# The RDMA transport is linked in when its source exists (agent/transport/transports.c).
HAVE_RDMA   := $(if $(wildcard agent/transport/rdma/rdma.c),-DSX_HAVE_RDMA)
# CUDA memory (agent/mem/) is compiled in when the toolkit's cuda.h is found; the
# driver itself is loaded at run time (dlopen), so nothing links against CUDA.
CUDA_HOME   ?= /usr/local/cuda
HAVE_CUDA   := $(if $(wildcard $(CUDA_HOME)/include/cuda.h),-DSX_HAVE_CUDA -isystem $(CUDA_HOME)/include)
CPPFLAGS_SX := -D_GNU_SOURCE -Iinclude -Imeta -Iagent -I$(BUILD)/gen $(HAVE_RDMA) $(HAVE_CUDA)
CFLAGS_SX   := -std=c11 $(WARN) $(OPT) -fPIC -fvisibility=hidden -MMD -MP
LDFLAGS_SX  :=
ifneq ($(SANITIZE),)
CFLAGS_SX  += -fsanitize=$(SANITIZE) -fno-omit-frame-pointer -fno-sanitize-recover=all
LDFLAGS_SX += -fsanitize=$(SANITIZE)
endif
ALL_CFLAGS  = $(CPPFLAGS_SX) $(CFLAGS_SX) $(PKG_CFLAGS) $(CFLAGS)
ALL_LDFLAGS = $(LDFLAGS_SX) $(LDFLAGS)

# ---------------------------------------------------------------- sources
PROTO     := proto/segxfer.proto
GEN_C     := $(BUILD)/gen/segxfer.pb-c.c
GEN_H     := $(BUILD)/gen/segxfer.pb-c.h
# The library: the metadata core (meta/) and its store backends (meta/<backend>/),
# the agent core (agent/) and its transports (agent/transport/<name>/).  The
# other folders under agent/ are programs.
LIB_SRCS  := $(wildcard meta/*.c meta/*/*.c agent/*.c agent/mem/*.c agent/transport/*.c \
                        agent/transport/*/*.c)
LIB_OBJS  := $(LIB_SRCS:%.c=$(BUILD)/obj/%.o) $(BUILD)/obj/gen/segxfer.pb-c.o
STATIC    := $(BUILD)/lib/libsegxfer.a
SHARED    := $(BUILD)/lib/libsegxfer.so.$(VERSION)
SONAME    := libsegxfer.so.$(SOVERSION)

# Programs: each is the .c files of its folder under agent/.
PROG_DIR_sx-agent := agent/sx-agent
PROG_DIR_sxctl    := agent/sxctl
PROG_DIR_sx-bench := agent/bench
PROGRAMS  := $(foreach p,sx-agent sxctl sx-bench,$(if $(wildcard $(PROG_DIR_$(p))/*.c),$(p)))
PROG_BINS := $(PROGRAMS:%=$(BUILD)/bin/%)
# Manual pages: <folder>/<program>.1 beside each program's sources (so
# agent/bench/sx-bench.1 is picked up as soon as it exists); installed into
# $(MANDIR)/man1 and checked by tests/man/check.sh.
MAN_PAGES := $(foreach p,$(PROGRAMS),$(wildcard $(PROG_DIR_$(p))/$(p).1))

# The test registry.  Each name is tests/<name>.c, one cmocka binary.
#   UNIT_TESTS  need nothing outside the process.
#   INTEG_TESTS start real servers (redis-server, etcd) themselves.
UNIT_TESTS  := test_errors test_codec test_layout test_plan test_group test_url test_store test_planner \
               test_frame test_cache test_agent test_agent_lifecycle test_stats test_rdma \
               test_push test_push_tcp test_batch_ids test_mem test_desc_host test_frame_ipc \
               test_read_notice test_cluster_slots test_rdma_stage test_desc_nic test_rdma_nic \
               test_tcp_window test_tcp_scatter test_tcp_threads test_tcp_readv test_op test_deadline
INTEG_TESTS := test_store_redis test_store_sentinel test_store_cluster test_store_index test_store_etcd test_sxctl test_e2e_agent test_metrics \
               test_faults test_faults_store test_faults_net test_security test_e2e_push
TEST_BINS   := $(addprefix $(BUILD)/tests/,$(UNIT_TESTS) $(INTEG_TESTS))
# The engine guide's program (docs/engine-guide.md), run by tests/docs/check-example.sh.
DOCS_EXAMPLE := $(BUILD)/tests/docs/engine_example
# The GPU suite (tests/gpu/): run by make test-gpu where a CUDA device is;
# make test runs it too, or prints why it skipped.
GPU_TESTS   := test_gpu_tcp test_gpu_ipc test_gpu_push test_gpu_dmabuf test_gpu_stride \
               test_gpu_group
GPU_BINS    := $(addprefix $(BUILD)/tests/gpu/,$(GPU_TESTS) gpu_probe drv_cost cpu_lines libfakecuda.so)
SOAK_BIN    := $(BUILD)/tests/soak/soak

# Fuzz targets: tests/fuzz/<name>.c defines LLVMFuzzerTestOneInput; its seeds
# are tests/fuzz/corpus/<name without fuzz_>/ and every crash found becomes a
# file in tests/fuzz/regressions/<same>/.  `make check` runs each target over
# both with a plain driver; `make fuzz FUZZ_SECONDS=N` runs libFuzzer (clang).
FUZZ_TARGETS := fuzz_desc fuzz_event fuzz_url fuzz_layout fuzz_frame fuzz_etcd fuzz_redis fuzz_notice \
                $(if $(wildcard agent/transport/rdma/rdma.c),fuzz_rdma)
FUZZ_SECONDS ?= 30
FUZZ_BINS    := $(FUZZ_TARGETS:%=$(BUILD)/fuzz/%)
TEST_SUPPORT := $(wildcard tests/support/*.c)
TEST_SUPPORT_OBJS := $(TEST_SUPPORT:%.c=$(BUILD)/obj/%.o)

# The RDMA suite (tests/rdma/): programs built here, run where an RDMA device
# exists, which on most machines means inside the Soft-RoCE VM that
# tests/rdma/run-in-rxe-vm.sh boots.  $(RDMA_PAYLOAD) is the VM's /payload.
# The end-to-end test there runs sx-agent, sxctl and redis-server too.
RDMA_PAYLOAD := $(BUILD)/rdma-tests
RDMA_BINS    := $(RDMA_PAYLOAD)/sx-rdma-test $(RDMA_PAYLOAD)/test_rdma_e2e \
                $(RDMA_PAYLOAD)/run.sh $(PROGRAMS:%=$(RDMA_PAYLOAD)/%) \
                $(RDMA_PAYLOAD)/test_rdma_push $(RDMA_PAYLOAD)/libfakecuda.so \
                $(RDMA_PAYLOAD)/test_rdma_notice $(RDMA_PAYLOAD)/test_rdma_gpu \
                $(RDMA_PAYLOAD)/test_rdma_gpu_push \
                $(RDMA_PAYLOAD)/libsxibvshim.so

# The Python package (python/segxfer, ctypes over libsegxfer.so) and its tests
# (tests/python/), run with Debian's interpreter: python3-torch, -numpy and
# -pytest install there (`python3` on PATH may be another one).  The C helpers
# beside them: the ABI probe the tests compare the ctypes structs with, and
# the C reader of the binding benchmark.
PYTHON       ?= /usr/bin/python3
PY_TEST_BINS := $(BUILD)/tests/python/abi_probe $(BUILD)/tests/python/bench_read
PYTHONDIR    ?= $(PREFIX)/lib/python$(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)/dist-packages
PY_SRCS      := $(wildcard python/segxfer/*.py)
# Beside the package: segxfer.pth runs at every interpreter start and imports
# _segxfer_hook only when SEGXFER_LMDEPLOY is set (docs/engines.md).
PY_HOOK      := python/_segxfer_hook.py python/segxfer.pth
# Beside the package: segxfer-sglang.pth runs at every interpreter start and
# imports _segxfer_sglang_hook only when SEGXFER_SGLANG is set (docs/engines.md#sglang);
# that hook uses _segxfer_hook's import-hook machinery, so both go together.
PY_SGLANG_HOOK := python/_segxfer_sglang_hook.py python/segxfer-sglang.pth

# ---------------------------------------------------------------- targets
.PHONY: all deps test check check-scripts check-fuzz-corpus check-fuzz-ci check-rdma bench bench-rdma fuzz \
        fuzz-run memcheck soak run cluster install uninstall clean print-build test-python test-gpu
.DEFAULT_GOAL := all

# Builds use every core; a -j on the command line wins (make -j1 for a serial
# build).  Tests themselves run one after another in the recipes.
MAKEFLAGS += -j$(shell nproc)

all: $(STATIC) $(BUILD)/lib/libsegxfer.so $(PROG_BINS) $(BUILD)/segxfer.pc

print-build:
	@echo $(BUILD)

deps:
	@missing=""; for p in $(DEB_PKGS); do \
	  dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q "install ok installed" \
	    || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "deps: installing$$missing"; \
	  if [ "$$(id -u)" != 0 ]; then SUDO=sudo; else SUDO=; fi; \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing; \
	fi

# `make test` and `make run` install what is missing first, then re-enter make so
# that pkg-config sees the freshly installed libraries.
test: deps
	@$(MAKE) --no-print-directory check

check: all $(TEST_BINS) $(FUZZ_BINS) $(SOAK_BIN) $(RDMA_BINS) $(DOCS_EXAMPLE) $(PY_TEST_BINS) $(GPU_BINS)
	@tests/run-tests.sh "$(BUILD)" unit $(UNIT_TESTS)
	@$(MAKE) --no-print-directory check-fuzz-corpus
	@tests/beside.sh $(BUILD)/test-logs/gpu-suite.out \
	  'SX_GPU_SANITIZED=$(if $(SANITIZE),1,0) tests/gpu/run.sh "$(BUILD)"' \
	  tests/run-tests.sh "$(BUILD)" integration $(INTEG_TESTS)
	@tests/beside.sh $(BUILD)/test-logs/check-rdma.out '$(RDMA_ENV)tests/rdma/check.sh "$(BUILD)"' \
	  env PYTHON=$(PYTHON) tests/python/run.sh "$(BUILD)"
	@$(MAKE) --no-print-directory soak DURATION=$(CI_SOAK_SECONDS) SOAK_QUIET=1
	@mkdir -p $(BUILD)/test-logs
	@if agent/demo/run-demo.sh "$(BUILD)" >$(BUILD)/test-logs/demo.log 2>&1; then \
	  echo "  PASS  make run demo (agent/demo/run-demo.sh)"; \
	else cat $(BUILD)/test-logs/demo.log; echo "  FAIL  make run demo"; exit 1; fi
	@tests/bench/smoke.sh "$(BUILD)"
	@tests/beside.sh $(BUILD)/test-logs/fuzz-ci.out '$(MAKE) --no-print-directory check-fuzz-ci' \
	  sh -c '$(SCRIPTS_STEP)'

# The deployment scripts (a local cluster in network namespaces, Redis
# Cluster, TLS), the manifests, the install, the docs and the manual pages:
# scripts and files, not library code, so a sanitizer build leaves them out.
# make check runs them beside the fuzzers (one core; the scripts mostly wait).
ifeq ($(SANITIZE),)
SCRIPTS_STEP = $(MAKE) --no-print-directory check-scripts
else
SCRIPTS_STEP = echo "  SKIP  deploy, install, docs and manual-page checks (make check-scripts): the plain build runs them"
endif
check-scripts: all $(DOCS_EXAMPLE)
	@tests/man/check.sh "$(BUILD)" "$(VERSION)" $(MAN_PAGES)
	@tests/deploy/test_local_cluster.sh "$(BUILD)"
	@tests/deploy/test_redis_cluster.sh "$(BUILD)"
	@tests/deploy/test_redis_tls.sh "$(BUILD)"
	@tests/deploy/check_manifests.sh "$(BUILD)"
	@tests/install/test_install.sh "$(BUILD)" "$(MAKE)" "$(if $(SANITIZE),-fsanitize=$(SANITIZE))"
	@tests/docs/check-links.sh "$(BUILD)"
	@tests/docs/check-layers.sh "$(BUILD)"
	@tests/docs/check-example.sh "$(BUILD)"

# Only the Python package's tests (deps first, like test).
test-python: deps
	@$(MAKE) --no-print-directory all $(PY_TEST_BINS)
	@PYTHON=$(PYTHON) tests/python/run.sh "$(BUILD)"

# The GPU suite alone; fails when there is no GPU.
test-gpu: all $(GPU_BINS)
	@tests/gpu/run.sh "$(BUILD)" --require

# Directly on an RDMA device, else in the Soft-RoCE VM(s); skips (saying so)
# only when the VM cannot start.  Logs: $(BUILD)/test-logs/rdma-*.log.
# A sanitizer build skips the two-VM run (the same code as the one-VM run's
# two processes, across two hosts; the plain build runs it): CI time.
# `make check` runs the suite beside the Python tests (tests/beside.sh).
RDMA_ENV := $(if $(SANITIZE),SX_RDMA_TWO_VMS=$${SX_RDMA_TWO_VMS:-0} )
check-rdma: $(RDMA_BINS)
	@$(RDMA_ENV)tests/rdma/check.sh "$(BUILD)"

# segxfer's batched READs against ib_read_bw on the same rxe device.
bench-rdma: $(RDMA_BINS)
	@tests/rdma/check.sh "$(BUILD)" perf

# `make check` runs every libFuzzer target for CI_FUZZ_SECONDS each, in the
# plain build only (the fuzz build is sanitized by itself), when clang with
# libFuzzer is there; it says so and skips otherwise.
CI_FUZZ_SECONDS ?= 5
# ... and a short soak (`make soak` runs a long one).
CI_SOAK_SECONDS ?= 20
check-fuzz-ci:
	@mkdir -p $(BUILD)/test-logs
	@if [ -n "$(SANITIZE)" ]; then \
	  echo "  SKIP  fuzzing: it runs in the plain build's make check (its build is sanitized)"; \
	elif ! printf 'int LLVMFuzzerTestOneInput(const char *d, unsigned long n) { return 0; }\n' | \
	    clang -x c -fsanitize=fuzzer -o /dev/null - >/dev/null 2>&1; then \
	  echo "  SKIP  fuzzing: clang with libFuzzer is not installed (make deps installs clang)"; \
	else start=$$(date +%s); \
	  if $(MAKE) --no-print-directory BUILD=build-fuzz CC=clang \
	      SANITIZE=fuzzer-no-link,address,undefined FUZZ_SECONDS=$(CI_FUZZ_SECONDS) \
	      fuzz-run >$(BUILD)/test-logs/fuzz.log 2>&1; then \
	    printf '  PASS  %-28s %5ss\n' "fuzz ($(CI_FUZZ_SECONDS) s per target)" $$(($$(date +%s) - start)); \
	  else cat $(BUILD)/test-logs/fuzz.log | tail -n 60; echo "  FAIL  fuzz"; exit 1; fi; \
	fi

# Every unit test under valgrind memcheck: no error, no leak; two at a time
# (valgrind runs a program's threads one at a time: one core each).
MEMCHECK_JOBS ?= 2
MEMCHECK := valgrind -q --error-exitcode=1 --leak-check=full \
            --errors-for-leak-kinds=definite,indirect,possible \
            --show-leak-kinds=definite,indirect,possible
memcheck: $(addprefix $(BUILD)/tests/,$(UNIT_TESTS))
	@if [ -n "$(SANITIZE)" ]; then echo "memcheck: not with SANITIZE (valgrind and the sanitizers do not mix)"; exit 2; fi
	@command -v valgrind >/dev/null || { echo "memcheck: valgrind is not installed (make deps)"; exit 2; }
	@SX_TEST_WRAPPER="$(MEMCHECK)" SX_TEST_TIMEOUT=600 SX_TEST_JOBS=$(MEMCHECK_JOBS) \
	  tests/run-tests.sh "$(BUILD)" memcheck $(UNIT_TESTS)

# Readers verifying every byte against targets restarted at random
# (tests/soak/soak.c): the report goes to the terminal, or with SOAK_QUIET=1
# (make check) to BUILD/test-logs/soak.log, shown when it fails.
DURATION ?= 60
soak: all $(SOAK_BIN)
	@mkdir -p $(BUILD)/test-logs
	@if [ -z "$(SOAK_QUIET)" ]; then $(SOAK_BIN) $(DURATION); else start=$$(date +%s); \
	  if $(SOAK_BIN) $(DURATION) >$(BUILD)/test-logs/soak.log 2>&1; then \
	    printf '  PASS  %-28s %5ss\n' "soak ($(DURATION) s)" $$(($$(date +%s) - start)); \
	    grep -E '^soak: [0-9]' $(BUILD)/test-logs/soak.log | sed 's/^/        /'; \
	  else cat $(BUILD)/test-logs/soak.log; echo "  FAIL  soak"; exit 1; fi; fi

check-fuzz-corpus: $(FUZZ_BINS)
	@for t in $(FUZZ_TARGETS); do c=$${t#fuzz_}; \
	  $(BUILD)/fuzz/$$t tests/fuzz/corpus/$$c tests/fuzz/regressions/$$c || exit 1; done

# libFuzzer: the library and targets are rebuilt with clang into build-fuzz/.
fuzz: deps
	@$(MAKE) --no-print-directory BUILD=build-fuzz CC=clang \
	  SANITIZE=fuzzer-no-link,address,undefined fuzz-run

fuzz-run: $(FUZZ_TARGETS:%=$(BUILD)/fuzzer/%)
	@for t in $(FUZZ_TARGETS); do c=$${t#fuzz_}; \
	  mkdir -p $(BUILD)/fuzz-corpus/$$c $(BUILD)/fuzz-crashes/$$c; \
	  echo "fuzz: $$t for $(FUZZ_SECONDS) s"; \
	  seeds=tests/fuzz/corpus/$$c; \
	  if [ -d tests/fuzz/regressions/$$c ]; then seeds="$$seeds tests/fuzz/regressions/$$c"; fi; \
	  $(BUILD)/fuzzer/$$t -max_total_time=$(FUZZ_SECONDS) -print_final_stats=0 \
	    -artifact_prefix=$(BUILD)/fuzz-crashes/$$c/ $(BUILD)/fuzz-corpus/$$c \
	    $$seeds 2>$(BUILD)/fuzz-$$c.log \
	    || { tail -n 40 $(BUILD)/fuzz-$$c.log; echo "fuzz: $$t crashed; the input is in $(BUILD)/fuzz-crashes/$$c/ (add it to tests/fuzz/regressions/$$c/)"; exit 1; }; \
	  grep -E '^#[0-9]+.*DONE' $(BUILD)/fuzz-$$c.log | tail -n 1; \
	done

run: deps
	@$(MAKE) --no-print-directory all
	@agent/demo/run-demo.sh "$(BUILD)"

# The multi-host demo on network namespaces (root): deploy/local-cluster.sh.
cluster: deps
	@$(MAKE) --no-print-directory all
	@SXLC_BIN=$(BUILD)/bin deploy/local-cluster.sh demo

# The representative benchmark set: each figure with its same-run baseline,
# the issue's targets judged on their ratios.  BENCH_DURATION scales it.
BENCH_DURATION ?= 1
bench: deps
	@$(MAKE) --no-print-directory all $(RDMA_BINS) $(PY_TEST_BINS)
	@tests/bench/run-bench.sh "$(BUILD)" "$(BENCH_DURATION)"
	@$(PYTHON) tests/python/bench.py "$(BUILD)"

# ---------------------------------------------------------------- build rules
# V=1 shows full command lines.
V ?= 0
ifeq ($(V),0)
say = @printf '  %-7s %s\n' '$(1)' '$(2)';
else
say =
endif

$(GEN_C) $(GEN_H) &: $(PROTO)
	@mkdir -p $(BUILD)/gen
	$(call say,PROTOC,$<)protoc-c --c_out=$(BUILD)/gen -Iproto $(PROTO)

# Everything compiled waits for the generated header.
$(BUILD)/obj/%.o: %.c | $(GEN_H)
	@mkdir -p $(dir $@)
	$(call say,CC,$<)$(CC) $(ALL_CFLAGS) -c $< -o $@

# The transport list changes when agent/transport/rdma/rdma.c appears.
$(BUILD)/obj/agent/transport/transports.o: $(wildcard agent/transport/rdma/rdma.c)

$(BUILD)/obj/gen/segxfer.pb-c.o: $(GEN_C) $(GEN_H)
	@mkdir -p $(dir $@)
	$(call say,CC,$<)$(CC) $(ALL_CFLAGS) -c $< -o $@

$(STATIC): $(LIB_OBJS)
	@mkdir -p $(dir $@)
	@rm -f $@
	$(call say,AR,$@)$(AR) rcs $@ $^

$(SHARED): $(LIB_OBJS)
	@mkdir -p $(dir $@)
	$(call say,LD,$@)$(CC) -shared -Wl,-soname,$(SONAME) -Wl,--no-undefined $(ALL_LDFLAGS) -o $@ $^ $(PKG_LIBS) -lpthread

$(BUILD)/lib/libsegxfer.so: $(SHARED)
	@ln -sf libsegxfer.so.$(VERSION) $(BUILD)/lib/$(SONAME)
	@ln -sf $(SONAME) $@

# Programs link the static library so that they run from the build tree.
define PROGRAM_RULE
$(BUILD)/bin/$(1): $$(patsubst %.c,$(BUILD)/obj/%.o,$$(wildcard $$(PROG_DIR_$(1))/*.c)) $(STATIC)
	@mkdir -p $$(dir $$@)
	$$(call say,LD,$$@)$$(CC) $$(ALL_LDFLAGS) -o $$@ $$^ $$(PKG_LIBS) -lpthread -lm
endef
$(foreach p,$(PROGRAMS),$(eval $(call PROGRAM_RULE,$(p))))

$(BUILD)/obj/tests/%.o: tests/%.c | $(GEN_H)
	@mkdir -p $(dir $@)
	$(call say,CC,$<)$(CC) $(ALL_CFLAGS) $(TEST_CFLAGS) -Itests -Itests/support -c $< -o $@

$(BUILD)/tests/%: $(BUILD)/obj/tests/%.o $(TEST_SUPPORT_OBJS) $(STATIC)
	@mkdir -p $(dir $@)
	$(call say,LD,$@)$(CC) $(ALL_LDFLAGS) -o $@ $^ $(TEST_LIBS) $(PKG_LIBS) -lpthread -lm

# The Python tests' C helpers (ABI probe, benchmark reader) need the library
# only (a more specific pattern than the one above, so make prefers it).
$(BUILD)/tests/python/%: $(BUILD)/obj/tests/python/%.o $(STATIC)
	@mkdir -p $(dir $@)
	$(call say,LD,$@)$(CC) $(ALL_LDFLAGS) -o $@ $^ $(PKG_LIBS) -lpthread -lm

$(BUILD)/tests/gpu/%: $(BUILD)/obj/tests/gpu/%.o $(BUILD)/obj/tests/gpu/gpu_fixture.o \
                      $(TEST_SUPPORT_OBJS) $(STATIC)
	@mkdir -p $(dir $@)
	$(call say,LD,$@)$(CC) $(ALL_LDFLAGS) -o $@ $^ $(TEST_LIBS) $(PKG_LIBS) -lpthread -lm
# test_gpu_ipc's lying target (a relay thread) is a file of its own.
$(BUILD)/tests/gpu/test_gpu_ipc: $(BUILD)/obj/tests/gpu/ipc_relay.o

# The host-memory stand-in for libcuda.so.1 (tests/gpu/fake_cuda.c).
# Under ThreadSanitizer the stand-in is instrumented too: its streams'
# threads publish what they did by release stores (the flag words of
# SX_GPU_NOTICE=auto), which an uninstrumented library would hide.
$(BUILD)/tests/gpu/libfakecuda.so: tests/gpu/fake_cuda.c
	@mkdir -p $(dir $@)
	$(call say,LD,$@)$(CC) -std=c11 $(OPT) -Wall -Wextra -Werror -fPIC -shared \
	  -fvisibility=hidden $(if $(filter thread,$(SANITIZE)),-fsanitize=thread) $(HAVE_CUDA) \
	  -o $@ $< -lpthread

# sx-rdma-test is the tests/rdma/sx_rdma_*.c files (sx_rdma_test.h lists them).
$(RDMA_PAYLOAD)/sx-rdma-test: $(patsubst %.c,$(BUILD)/obj/%.o,$(wildcard tests/rdma/sx_rdma_*.c)) $(STATIC)
	@mkdir -p $(dir $@)
	$(call say,LD,$@)$(CC) $(ALL_LDFLAGS) -o $@ $^ $(PKG_LIBS) -lpthread -lm

$(RDMA_PAYLOAD)/test_rdma_e2e: $(BUILD)/obj/tests/rdma/test_rdma_e2e.o $(TEST_SUPPORT_OBJS) $(STATIC)
	@mkdir -p $(dir $@)
	$(call say,LD,$@)$(CC) $(ALL_LDFLAGS) -o $@ $^ $(TEST_LIBS) $(PKG_LIBS) -lpthread -lm

$(RDMA_PAYLOAD)/test_rdma_push: $(BUILD)/obj/tests/rdma/test_rdma_push.o $(TEST_SUPPORT_OBJS) $(STATIC)
	@mkdir -p $(dir $@)
	$(call say,LD,$@)$(CC) $(ALL_LDFLAGS) -o $@ $^ $(TEST_LIBS) $(PKG_LIBS) -lpthread -lm

$(RDMA_PAYLOAD)/test_rdma_notice: $(BUILD)/obj/tests/rdma/test_rdma_notice.o $(TEST_SUPPORT_OBJS) $(STATIC)
	@mkdir -p $(dir $@)
	$(call say,LD,$@)$(CC) $(ALL_LDFLAGS) -o $@ $^ $(TEST_LIBS) $(PKG_LIBS) -lpthread -lm

$(RDMA_PAYLOAD)/test_rdma_gpu: $(BUILD)/obj/tests/rdma/test_rdma_gpu.o $(TEST_SUPPORT_OBJS) $(STATIC)
	@mkdir -p $(dir $@)
	$(call say,LD,$@)$(CC) $(ALL_LDFLAGS) -o $@ $^ $(TEST_LIBS) $(PKG_LIBS) -lpthread -lm

$(RDMA_PAYLOAD)/test_rdma_gpu_push: $(BUILD)/obj/tests/rdma/test_rdma_gpu_push.o $(TEST_SUPPORT_OBJS) $(STATIC)
	@mkdir -p $(dir $@)
	$(call say,LD,$@)$(CC) $(ALL_LDFLAGS) -o $@ $^ $(TEST_LIBS) $(PKG_LIBS) -lpthread -lm

# test_rdma_push registers GPU regions on the host-memory stand-in driver.
$(RDMA_PAYLOAD)/libfakecuda.so: $(BUILD)/tests/gpu/libfakecuda.so
	@mkdir -p $(dir $@)
	@cp $< $@

# test_rdma_gpu dmabuf|peermem: an LD_PRELOAD provider shim over the stand-in.
$(RDMA_PAYLOAD)/libsxibvshim.so: tests/rdma/sx_ibv_shim.c
	@mkdir -p $(dir $@)
	$(call say,LD,$@)$(CC) -std=c11 $(OPT) -Wall -Wextra -Werror -fPIC -shared \
	  -fvisibility=hidden -o $@ $< -libverbs -ldl

# Copies, not links: the directory is all the VM sees.
$(RDMA_PAYLOAD)/run.sh: tests/rdma/run.sh
	@mkdir -p $(dir $@)
	@cp $< $@

$(RDMA_PAYLOAD)/%: $(BUILD)/bin/%
	@mkdir -p $(dir $@)
	@cp $< $@

# segxfer.pc is written for the PREFIX/LIBDIR in effect, by `make all` into
# the build dir and again by `make install` for the install location.
define write_pc
	@mkdir -p $(dir $(1))
	@printf '%s\n' \
	  'prefix=$(PREFIX)' 'includedir=$(INCDIR)' 'libdir=$(LIBDIR)' '' \
	  'Name: segxfer' \
	  'Description: named, leased, layout-checked KV-cache segments and batched RDMA/TCP block reads' \
	  'Version: $(VERSION)' \
	  'Requires.private: $(PKGS)' \
	  'Cflags: -I$${includedir}' \
	  'Libs: -L$${libdir} -lsegxfer' \
	  'Libs.private: -lpthread -lm' > $(1)
endef

# Fuzz targets: a plain driver for check, libFuzzer's main for `make fuzz`.
$(BUILD)/fuzz/%: $(BUILD)/obj/tests/fuzz/%.o $(BUILD)/obj/tests/fuzz/driver.o $(STATIC)
	@mkdir -p $(dir $@)
	$(call say,LD,$@)$(CC) $(ALL_LDFLAGS) -o $@ $^ $(PKG_LIBS) -lpthread -lm

$(BUILD)/fuzzer/%: $(BUILD)/obj/tests/fuzz/%.o $(STATIC)
	@mkdir -p $(dir $@)
	$(call say,LD,$@)$(CC) $(ALL_LDFLAGS) -fsanitize=fuzzer -o $@ $^ $(PKG_LIBS) -lpthread -lm

$(BUILD)/segxfer.pc: Makefile
	$(call write_pc,$@)

# ---------------------------------------------------------------- install
# uninstall removes exactly the files install puts (and the include/segxfer
# directory when that leaves it empty); tests/install/test_install.sh checks
# that nothing is left behind.
HEADERS := $(wildcard include/segxfer/*.h)

install: all
	install -d $(DESTDIR)$(INCDIR)/segxfer $(DESTDIR)$(LIBDIR)/pkgconfig $(DESTDIR)$(BINDIR)
	install -m 644 include/segxfer.h $(DESTDIR)$(INCDIR)/
	install -m 644 $(HEADERS) $(DESTDIR)$(INCDIR)/segxfer/
	install -m 644 $(STATIC) $(DESTDIR)$(LIBDIR)/
	install -m 755 $(SHARED) $(DESTDIR)$(LIBDIR)/
	ln -sf libsegxfer.so.$(VERSION) $(DESTDIR)$(LIBDIR)/$(SONAME)
	ln -sf $(SONAME) $(DESTDIR)$(LIBDIR)/libsegxfer.so
	$(call write_pc,$(DESTDIR)$(LIBDIR)/pkgconfig/segxfer.pc)
	$(if $(PROG_BINS),install -m 755 $(PROG_BINS) $(DESTDIR)$(BINDIR)/)
	$(if $(MAN_PAGES),install -d $(DESTDIR)$(MANDIR)/man1)
	$(if $(MAN_PAGES),install -m 644 $(MAN_PAGES) $(DESTDIR)$(MANDIR)/man1/)
	install -d $(DESTDIR)$(PYTHONDIR)/segxfer
	install -m 644 $(PY_SRCS) $(DESTDIR)$(PYTHONDIR)/segxfer/
	install -m 644 $(PY_HOOK) $(DESTDIR)$(PYTHONDIR)/
	install -m 644 $(PY_SGLANG_HOOK) $(DESTDIR)$(PYTHONDIR)/

uninstall:
	rm -f $(DESTDIR)$(INCDIR)/segxfer.h \
	      $(HEADERS:include/segxfer/%=$(DESTDIR)$(INCDIR)/segxfer/%)
	rmdir $(DESTDIR)$(INCDIR)/segxfer 2>/dev/null || true
	rm -f $(DESTDIR)$(LIBDIR)/libsegxfer.a $(DESTDIR)$(LIBDIR)/libsegxfer.so \
	      $(DESTDIR)$(LIBDIR)/$(SONAME) $(DESTDIR)$(LIBDIR)/libsegxfer.so.$(VERSION) \
	      $(DESTDIR)$(LIBDIR)/pkgconfig/segxfer.pc
	rm -f $(PROGRAMS:%=$(DESTDIR)$(BINDIR)/%)
	rm -f $(patsubst %,$(DESTDIR)$(MANDIR)/man1/%,$(notdir $(MAN_PAGES)))
	rm -f $(PY_SRCS:python/segxfer/%=$(DESTDIR)$(PYTHONDIR)/segxfer/%)
	rm -rf $(DESTDIR)$(PYTHONDIR)/segxfer/__pycache__
	rmdir $(DESTDIR)$(PYTHONDIR)/segxfer 2>/dev/null || true
	rm -f $(PY_HOOK:python/%=$(DESTDIR)$(PYTHONDIR)/%) \
	      $(DESTDIR)$(PYTHONDIR)/__pycache__/_segxfer_hook.*.pyc
	rm -f $(PY_SGLANG_HOOK:python/%=$(DESTDIR)$(PYTHONDIR)/%) \
	      $(DESTDIR)$(PYTHONDIR)/__pycache__/_segxfer_sglang_hook.*.pyc
	rmdir $(DESTDIR)$(PYTHONDIR)/__pycache__ 2>/dev/null || true

clean:
	rm -rf build build-*

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
.SECONDARY:
