"""deconv inference service: ConvTranspose2d layers over HTTP (native /deconv and KServe v2), dynamically batched.

Run it with ``python -m service``; build an app with ``service.http.app.create_app``.
"""
