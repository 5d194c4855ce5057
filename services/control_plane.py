"""In a checkout: ``python -m services.control_plane`` runs ``dd_queue.services.control_plane``."""

from dd_queue.services.control_plane import main

if __name__ == "__main__":
    raise SystemExit(main())
