"""A password hasher for the test process: the same algorithm, far fewer rounds."""

from __future__ import annotations

from django.contrib.auth.hashers import PBKDF2PasswordHasher


class QuickPBKDF2PasswordHasher(PBKDF2PasswordHasher):
    """``pbkdf2_sha256`` at 1,000 rounds instead of Django's 1,000,000 (about 0.35 s of CPU a user here).

    The hash names its rounds, so a web server the test starts (Django's own
    hashers) checks these passwords as it checks its own, and upgrades them
    on a login as it would any older hash.
    """

    iterations = 1_000
