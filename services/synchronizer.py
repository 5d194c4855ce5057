"""In a checkout: ``python -m services.synchronizer`` runs ``dd_queue.services.synchronizer``."""

from dd_queue.services.synchronizer import main

if __name__ == "__main__":
    raise SystemExit(main())
