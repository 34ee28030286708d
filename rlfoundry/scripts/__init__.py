"""Command-line tools run as ``python -m rlfoundry.scripts.<name>`` (verl ships them as scripts/)."""
