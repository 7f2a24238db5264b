# Every target sets up .venv/ first (a no-op once done), so each works on a fresh machine.
VENV := .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: setup serve test check proto
setup:
	@bash tools/setup_env.sh

serve: setup
	$(VENV)/bin/salience serve $(ARGS)

# Only the tests need a browser (tests/ui drives Debian's chromium); serving installs none.
# The slowest tests and every engine start (with its seconds) close the report: where the time goes.
test: setup
	@bash tools/setup_browser.sh
	$(PY) -m pytest --durations=25 $(ARGS)

check: setup
	$(VENV)/bin/ruff format --check salience tests tools
	$(VENV)/bin/ruff check salience tests tools

proto: setup
	$(PY) tools/gen_proto.py
