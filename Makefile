# Convenience aliases for ./dev, which does all set-up itself (see README).
.PHONY: run test clean
run:
	./dev run $(ARGS)
test:
	./dev test $(PYTEST_ARGS)
clean:
	rm -rf .venv .pytest_cache .mypy_cache .ruff_cache
