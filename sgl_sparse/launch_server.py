"""``python -m sgl_sparse.launch_server`` - see :mod:`sgl_sparse.integration.launch`."""

from sgl_sparse.integration.launch import main

if __name__ == "__main__":
    main()
