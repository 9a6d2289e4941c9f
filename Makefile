# Two commands do everything on a fresh machine (see README.md):
#   make demo   create .venv and run the main job
#   make test   create .venv, lint (docs build included), and run the test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup broker demo test lint docs bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e ".[dev,flower]"
	touch $(STAMP)

demo: setup
	$(BIN)/fedring simulate --agents 4 --dataset digits --compression group-topk --density 0.01

lint: setup
	$(BIN)/ruff check fedring tests bench examples
	$(BIN)/mypy fedring
	$(BIN)/lint-imports
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir site

# The docs site (mkdocs.yml): warnings are errors, so a broken link or an unreadable
# docstring fails `make lint` and `make test` too. Output in site/ (ignored by git).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# The MQTT tests start a real Mosquitto on loopback; install it when we can.
broker:
	@command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || \
	  { [ "$$(id -u)" = 0 ] && apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mosquitto mosquitto-clients; } || \
	  echo "note: mosquitto is not installed; the MQTT tests will be skipped (apt-get install mosquitto mosquitto-clients)"
	@[ "$$(id -u)" != 0 ] || [ -x /usr/sbin/nft ] || command -v nft >/dev/null 2>&1 || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables iproute2; } || \
	  echo "note: nftables is not installed; the lab's loss tests will be skipped"

test: lint broker
	$(BIN)/pytest -q -n 2 --dist loadgroup --durations=15

bench: setup
	$(BIN)/fedring bench compress --numel 10000000 --density 0.01
	$(BIN)/fedring simulate --agents 4 --dataset digits --compression group-topk --density 0.01
	$(BIN)/python bench/wall_time.py
	$(BIN)/python bench/onnx_eval.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis site
