"""Database backends of the project (selected by ``settings.DATABASES``)."""
