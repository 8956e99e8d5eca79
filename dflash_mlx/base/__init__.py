"""What every part shares: the error type, dtypes by name, files a user owns, the small JSON stores."""
