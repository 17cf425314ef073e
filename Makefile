# Spooler: make run | make test | make bench | make proto
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run cluster test test-fast test-all bench drill proto install clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# One node on 127.0.0.1 (HTTP 8080, gRPC 50051), data under ./var.
SPOOLER_ADMIN_KEY ?= dev-admin-key
run: $(STAMP)
	@echo "admin key: $(SPOOLER_ADMIN_KEY)"
	SPOOLER_ADMIN_KEY=$(SPOOLER_ADMIN_KEY) exec $(BIN)/spooler-node --id n1 --data ./var \
		--http 127.0.0.1:8080 --grpc 127.0.0.1:50051

# Three nodes on 127.0.0.1 (HTTP 8081-8083, gRPC 27061-27063), data under ./var/cluster.
cluster: $(STAMP)
	$(BIN)/python -m node.devcluster

# --durations: the slowest tests, for keeping the suite inside its time budget.
# Two pytest-xdist workers, a test file each at a time (its module-scoped nodes
# stay with it; the drills' file runs on one worker); TEST_WORKERS=0 runs the
# suite in this one process, as before 0.4.38.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=15 $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile,)

# The fast tier: no node process (the core, the simulation, the SDK against fakes,
# the job runner on its own), about 2 minutes.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m 'not slow and not integration'

# Everything, the slow drills included.
test-all: $(STAMP)
	$(BIN)/python -m pytest -q -m ''

# Long failover drills: make drill SEEDS=1-100 DURATION=30 [WORKDIR=dir] [KEEP=1] [POWER_LOSS=1] [PARTITIONS=1] [CASCADES=1] [DISK_LOSS=1] [GRACEFUL=1] [FSYNC_ERRORS=1] [CLIENT_PARTITIONS=1] [WRITE_ERRORS=1] [SLOW_LINKS=1] [SDK_CLIENTS=1] [DISK_LOW=1] [PURGES=1] [UPGRADE_FROM=previous|REV] [NODES=5] [FAULTS=kind,...]
SEEDS ?= 1-5
DURATION ?= 30
drill: $(STAMP)
	$(BIN)/python -m tests.drills.run --seeds $(SEEDS) --duration $(DURATION) $(if $(POWER_LOSS),--power-loss,) \
		$(if $(PARTITIONS),--partitions,) $(if $(CASCADES),--cascades,) $(if $(DISK_LOSS),--disk-loss,) \
		$(if $(GRACEFUL),--graceful,) $(if $(FSYNC_ERRORS),--fsync-errors,) $(if $(WRITE_ERRORS),--write-errors,) \
		$(if $(CLIENT_PARTITIONS),--client-partitions,) $(if $(SLOW_LINKS),--slow-links,) $(if $(SDK_CLIENTS),--sdk-clients,) $(if $(DISK_LOW),--disk-low,) $(if $(PURGES),--purges,) $(if $(UPGRADE_FROM),--upgrade-from $(UPGRADE_FROM),) $(if $(NODES),--nodes $(NODES),) $(if $(FAULTS),--faults $(FAULTS),) \
		$(if $(NODE_ARGS),--node-args "$(NODE_ARGS)",) $(if $(WORKDIR),--workdir $(WORKDIR),) $(if $(KEEP),--keep,)

bench: $(STAMP)
	$(BIN)/python -m bench.run

# Regenerate the protobuf/gRPC code from proto/ (reproducible: grpcio-tools is pinned).
proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. \
		proto/spooler/pb/log.proto proto/spooler/pb/api.proto proto/spooler/pb/replication.proto

clean:
	rm -rf $(VENV) var
