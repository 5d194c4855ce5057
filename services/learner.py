"""In a checkout: ``python -m services.learner`` runs ``dd_queue.services.learner``."""

from dd_queue.services.learner import main

if __name__ == "__main__":
    raise SystemExit(main())
