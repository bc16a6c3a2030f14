"""`python -m pipeline [overrides]`: see pipeline/app.py and README.md."""

from pipeline.app import main

if __name__ == "__main__":
    main()
