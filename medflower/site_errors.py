"""The error a site's app raises for a message it cannot handle: its text is all the server learns of the failure
(``site_app.handle`` redacts it; ``site_worker`` carries it from the site's worker back to the ClientApp)."""


class SiteError(RuntimeError):
    """What the server learns of a failure on a site (its message is all that leaves the site)."""
