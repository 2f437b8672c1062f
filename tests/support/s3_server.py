"""A real S3-compatible server for tests: moto in server mode, in a background thread, checking every
request's signature against an IAM access key (the default moto accepts any key, which would let a
credentials bug pass)."""
import json
from contextlib import contextmanager

ALLOW_ALL = json.dumps({"Version": "2012-10-17",
                        "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]})


@contextmanager
def s3_server(objects):
    """Serve `objects` ({bucket: {key: bytes}}); yields (endpoint, access key id, secret key)."""
    import boto3
    from moto import settings as moto_settings
    from moto.server import ThreadedMotoServer

    from portal.runner import free_port
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    bootstrap = dict(endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="bootstrap",
                     aws_secret_access_key="bootstrap")
    iam = boto3.client("iam", **bootstrap)
    user = f"trainer-{port}"  # moto keeps one IAM in the process, shared by every server it runs
    iam.create_user(UserName=user)
    iam.put_user_policy(UserName=user, PolicyName="all", PolicyDocument=ALLOW_ALL)
    key = iam.create_access_key(UserName=user)["AccessKey"]
    s3 = boto3.client("s3", **bootstrap)
    for bucket, contents in objects.items():
        s3.create_bucket(Bucket=bucket)
        for name, body in contents.items():
            s3.put_object(Bucket=bucket, Key=name, Body=body)
    previous = moto_settings.INITIAL_NO_AUTH_ACTION_COUNT
    moto_settings.INITIAL_NO_AUTH_ACTION_COUNT = 0  # from now on every request must be signed by a real key
    try:
        yield endpoint, key["AccessKeyId"], key["SecretAccessKey"]
    finally:
        moto_settings.INITIAL_NO_AUTH_ACTION_COUNT = previous
        server.stop()
