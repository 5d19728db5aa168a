"""Support shared by every part of the package: argument checks, the package's logger, CLI types, collectives."""
